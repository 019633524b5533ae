"""The batched decode engine: paged KV per layer, ragged sequences, eviction as the research loop
decides it, CUDA-graph decode steps.

    engine = DecodeEngine(model, batch=32, max_entries=512, policy=GateThreshold(0.05))
    out = engine.teacher_forced(tokens_BS, prefill=256)       # out.nll_BW, out.live_BL, ...

or step by step: ``engine.prefill(tokens_BT, lengths_B, n_inputs_B)`` then
``logits_BV = engine.step(tokens_B, pos_B, active_B)`` per token.

A sequence b has ``S_b`` tokens (``lengths_B``); it prefills its ``P_b`` first ones, then decodes
tokens ``P_b .. S_b - 2`` one per step, the step at position t scoring token t + 1 (teacher
forcing), the research loop's protocol (``eviction/decode.py``). Sequences of one batch may differ
in ``S_b`` and ``P_b``: each steps at its own position, and one whose window has ended stays in
the batch inactive (its rows compute, write nowhere and count nothing), so every step has the
batch's static shapes.

Eviction: ``NoEviction``, ``GateThreshold(tau)``, ``H2O``, ``KeyDiff`` (``eviction.policies``)
with the research loop's decisions. After the prefill every policy decides through its own
``drop_BHN`` on a research ``LayerCache`` of the prefill's entries. In a decode step, gate-tau
needs nothing but the new entry's gate (a kept entry's gate never changes): the entry is written,
attended, and not counted live when ``g < tau`` (no copy: its slot is the next write's); every
layer's such drop is made at once at the end of the step, where the counts of all layers (views
of one tensor) also give the keys each query read. H2O and
KeyDiff run ``drop_BHN`` on a position-ordered ``view`` of each row after the step (H2O's scores
come from the kernel's side output) and ``PagedKV.drop`` removes what they chose; those passes
read counts on the host and stay outside the CUDA graph.

The step (``_static_step``) reads no host value: on CUDA it is captured once in a CUDA graph
(``graph.StepGraph``) and replayed; on CPU it runs eagerly. Attention: ``triton`` (the decode
kernel; CUDA, or the CPU interpreter) or ``reference`` (PyTorch, any dtype; ``auto`` picks
triton on CUDA, reference on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stabilitylab.eviction.decode import Positions, attention_kind, check_decoder, embed_BTC
from stabilitylab.eviction.policies import H2O, CachePolicy, GateThreshold, KeyDiff, NoEviction
from stabilitylab.inference.layers import StepInputs, decode_block, prefill_block
from stabilitylab.inference.paged import PagedKV, logical_drop_BHN
from stabilitylab.kernels.reference import sigmoid_bias_B
from stabilitylab.kernels.triton_support import interpreter_available, interpreting
from stabilitylab.model import Transformer, inference, rope_cos_sin

IMPLS = ("auto", "triton", "reference")
POLICIES = (NoEviction, GateThreshold, H2O, KeyDiff)
DENSE = NoEviction()
Observer = Callable[[int, int, PagedKV], None]
"""``observer(step, layer, cache)`` after each layer's eviction; step -1 is the prefill."""


def resolve_impl(attention: str, device: torch.device, head_dim: int, dtype) -> str:
    """``triton`` or ``reference`` for ``attention`` (auto | triton | reference); refuses a
    Triton kernel that cannot run here, naming why."""
    if attention not in IMPLS:
        raise ValueError(f"attention must be one of {IMPLS}, got {attention!r}")
    fits = 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    fits = fits and dtype in (torch.bfloat16, torch.float16, torch.float32)
    if attention == "auto":
        return "triton" if device.type == "cuda" and fits else "reference"
    if attention == "triton":
        if not fits:
            raise ValueError(
                f"the decode kernel takes head dims 16-256 (powers of two) in bf16/fp16/fp32, "
                f"got head dim {head_dim} in {dtype}; use attention='reference'"
            )
        if device.type == "cpu" and not (interpreting() and interpreter_available()):
            raise ValueError(
                "attention='triton' on CPU needs TRITON_INTERPRET=1 set before Python starts"
            )
    return attention


def check_policy(policy: CachePolicy) -> CachePolicy:
    if not isinstance(policy, POLICIES):
        names = [p.__name__ for p in POLICIES]
        raise ValueError(f"the engine runs the policies {names}, got {type(policy).__name__}")
    return policy


@dataclass
class EngineOutput:
    """One batch through ``teacher_forced``. Entries count (token, head) rows of one layer."""

    nll_BW: torch.Tensor
    """``-log p(token t + 1)`` of decode step ``t = P_b + w``, float64; NaN past ``W_b``."""
    written_B: torch.Tensor
    """Entries each sequence wrote into each layer: ``n_heads * (S_b - 1)``."""
    live_BL: torch.Tensor
    """Live entries per sequence and layer after the last step."""
    keys_read_BL: torch.Tensor
    """Entries the decode steps' queries read, summed over steps and heads."""
    held_bytes_L: list[int]
    """K/V bytes of the pages each layer's rows hold after the last step (whole batch)."""
    live_bytes_L: list[int]
    """K/V bytes of the live entries alone, per layer (whole batch)."""


class DecodeEngine:
    """Module docstring. ``batch``: rows of the static step (a smaller batch is padded with
    inactive rows); ``max_entries``: entries a row can hold (its block table), at least the
    longest prefill; ``max_position``: the largest position + 1 (RoPE's table; default
    ``max_entries``); ``n_pages``: pages of each layer's pool (default: every row full)."""

    def __init__(
        self, model: Transformer, *, batch: int, max_entries: int,
        policy: CachePolicy = DENSE, page_size: int = 16, attention: str = "auto",
        n_pages: int | None = None, max_position: int | None = None, cuda_graph: bool = True,
    ) -> None:  # fmt: skip
        self.model = check_decoder(model)
        self.policy = check_policy(policy)
        cfg, p = model.cfg, next(model.parameters())
        self.batch, self.device, self.H = batch, p.device, cfg.n_heads
        self.kinds = [attention_kind(a.backend_name) for a in model.attention_layers]
        self.impl = resolve_impl(attention, p.device, cfg.head_dim, p.dtype)
        self.max_position = max_position or max_entries
        self.caches = [
            PagedKV.allocate(
                batch, cfg.n_heads, cfg.head_dim, max_entries=max_entries, page_size=page_size,
                dtype=p.dtype, device=p.device, n_pages=n_pages, scores=policy.needs_scores,
                key_bias=self._gated(layer) and model.blocks[layer].attn.gate_injection != "values",
            )
            for layer in range(cfg.n_layers)
        ]  # fmt: skip
        # Every layer's live counts are views of one tensor, so that the step's end reads and
        # changes all layers at once (keys read, gate-tau's drops): a few ops, not a few a layer.
        self.count_LBH = torch.zeros(cfg.n_layers, batch, cfg.n_heads, dtype=torch.int32, device=p.device)  # fmt: skip
        for layer, cache in enumerate(self.caches):
            cache.count_BH = self.count_LBH[layer]
        gated = [layer for layer in range(cfg.n_layers) if self._gated(layer)]
        self.gated_G = torch.tensor(gated, dtype=torch.long, device=p.device)
        """The layers whose entries carry a gate (a device index: no host copy in a capture)."""
        self.rope = None
        if cfg.position == "rope":
            self.rope = rope_cos_sin(self.max_position, cfg.head_dim, cfg.rope_base, p.device)
        self.bias_B = torch.zeros(batch, dtype=torch.float32, device=p.device)
        self.keys_read_BL = torch.zeros(batch, cfg.n_layers, dtype=torch.long, device=p.device)
        self.keep_BL: torch.Tensor | None = None
        self.graph = None
        if cuda_graph and p.device.type == "cuda":
            from stabilitylab.inference.graph import StepGraph

            self.graph = StepGraph(self)

    def _gated(self, layer: int) -> bool:
        """Whether layer ``layer``'s entries carry the previous block's gate."""
        return layer > 0 and self.model.blocks[layer - 1].gate_out is not None

    @property
    def tau(self) -> float | None:
        return self.policy.tau if isinstance(self.policy, GateThreshold) else None

    # ---- prefill ----------------------------------------------------------------------------

    def _check_prefill(self, tokens_BT, lengths_B, n_inputs_B, keep_BL) -> None:
        B, T = tokens_BT.shape
        L = len(self.caches)
        if B != self.batch:
            raise ValueError(f"the engine steps {self.batch} rows, got a batch of {B}")
        M = self.caches[0].table_BHM.shape[2] * self.caches[0].page_size
        if T > M or T > self.max_position:
            raise ValueError(f"a prefill of {T} tokens exceeds max_entries / max_position ({M}, {self.max_position})")  # fmt: skip
        if bool((lengths_B < 1).any()) or bool((lengths_B > T).any()):
            raise ValueError(f"prefill lengths must lie in [1, {T}], got {lengths_B.tolist()}")
        if bool((n_inputs_B < lengths_B).any()):
            raise ValueError("n_inputs_B (each window's input tokens) must be >= its prefill")
        if self.policy.needs_budget and (keep_BL is None or tuple(keep_BL.shape) != (B, L)):
            got = None if keep_BL is None else tuple(keep_BL.shape)
            raise ValueError(f"policy {self.policy.name} needs keep_BL of shape {(B, L)}, got {got}")  # fmt: skip

    def prefill(self, tokens_BT, lengths_B, n_inputs_B, keep_BL=None, observer=None) -> None:
        """Reset, then run each sequence's ``lengths_B[b]`` first tokens of ``tokens_BT``
        through every block at once (the training backends), writing the entries each policy
        keeps. ``n_inputs_B``: each window's input tokens (the sigmoid bias); ``keep_BL``: a
        budgeted policy's entries per head for each sequence and layer."""
        dev = self.device
        tokens_BT, lengths_B = tokens_BT.to(dev), lengths_B.to(dev)
        n_inputs_B = torch.as_tensor(n_inputs_B, device=dev)
        self._check_prefill(tokens_BT, lengths_B, n_inputs_B, keep_BL)
        for cache in self.caches:
            cache.reset()
        self.keys_read_BL.zero_()
        self.bias_B.copy_(sigmoid_bias_B(n_inputs_B, self.model.cfg.sigmoid_bias))
        self.keep_BL = None if keep_BL is None else keep_BL.to(dev, torch.long)
        model, T = self.model, tokens_BT.shape[1]
        with inference(model):
            at = Positions.of(model, 0, T, dev)
            x_BTC, gate_BT = embed_BTC(model, tokens_BT, at.pos_T), None
            for layer, (block, cache) in enumerate(zip(model.blocks, self.caches, strict=True)):
                x_BTC, pre = prefill_block(
                    block, x_BTC, at, lengths_B, gate_BT, self.kinds[layer], self.bias_B,
                    self.policy.needs_scores,
                )  # fmt: skip
                view = pre.as_cache(lengths_B)
                keep = None if self.keep_BL is None else self.keep_BL[:, layer]
                drop_BHT = self.policy.drop_BHN(view, keep)
                keep_BHT = view.live_BHN if drop_BHT is None else view.live_BHN & ~drop_BHT
                cache.write_prefill(pre.k_BHTD, pre.v_BHTD, pre.kb_BHT, keep_BHT, pre.score_BHT)
                gate_BT = block.gate_out(x_BTC) if block.gate_out is not None else None
                if observer is not None:
                    observer(-1, layer, cache)

    # ---- decode -----------------------------------------------------------------------------

    def _static_step(self, tokens_B, pos_B, active_B) -> torch.Tensor:
        """Every block over one token per row, no host read: ``logits_BV``."""
        model, B = self.model, tokens_B.shape[0]
        pos_B = torch.where(active_B, pos_B, 0)  # an ended row's position may pass the table
        rope = None
        if self.rope is not None:
            rope = tuple(t[pos_B][:, None, None, :] for t in self.rope)
        step = StepInputs(pos_B, active_B[:, None].expand(B, self.H), rope)
        x_B1C = model.tok_emb(tokens_B[:, None])
        if model.pos_emb is not None:
            x_B1C = x_B1C + model.pos_emb(pos_B)[:, None]
        gate_B1, g_LBH = None, []
        for layer, (block, cache) in enumerate(zip(model.blocks, self.caches, strict=True)):
            x_B1C, g_BH = decode_block(
                block, x_B1C, gate_B1, cache, step, self.kinds[layer], self.bias_B, self.impl
            )  # fmt: skip
            g_LBH.append(g_BH)
            gate_B1 = block.gate_out(x_B1C) if block.gate_out is not None else None
        # Each layer's query read its live entries, the new one counted (the counts as they are
        # now); then gate-tau drops the new entries whose g < tau (a NaN gate is kept, as in
        # the research rule).
        self.keys_read_BL += (self.count_LBH * active_B[None, :, None]).sum(-1).T
        if self.tau is not None:
            self._drop_below_tau(g_LBH, active_B)
        return model.head(model.ln_f(x_B1C[:, 0]))

    def _drop_below_tau(self, g_LBH: list, active_B: torch.Tensor) -> None:
        """``count -= active & (g < tau)`` for every gated layer (``gated_G``), in one update."""
        g_GBH = [g for g in g_LBH if g is not None]
        if not g_GBH:
            return
        drop_GBH = (torch.stack(g_GBH) < self.tau) & active_B[None, :, None]
        self.count_LBH[self.gated_G] -= drop_GBH.to(torch.int32)

    def _budget_pass(self, active_B) -> None:
        """H2O / KeyDiff: each layer's excess entries go (the research ``drop_BHN`` on a
        position-ordered view); ended rows keep theirs."""
        for layer, cache in enumerate(self.caches):
            view, order_BHN = cache.view(with_keys=isinstance(self.policy, KeyDiff))
            drop_BHN = self.policy.drop_BHN(view, self.keep_BL[:, layer])
            if drop_BHN is not None:
                drop_BHN = drop_BHN & active_B[:, None, None]
                cache.drop(logical_drop_BHN(drop_BHN, order_BHN))

    def step(self, tokens_B, pos_B, active_B, observer=None, index: int = 0) -> torch.Tensor:
        """One decode step: ``logits_BV`` of each row's token ``tokens_B`` at position
        ``pos_B``; rows with ``active_B`` False change nothing. On CUDA the logits are the
        graph's static buffer: read them before the next step. The model must be in eval
        mode (``teacher_forced`` puts it there; a per-step ``model.eval()`` would cost host
        time every step)."""
        if self.model.training:
            raise ValueError("the engine steps a model in eval mode; call model.eval() first")
        with torch.no_grad():
            if self.graph is not None:
                logits_BV = self.graph(tokens_B, pos_B, active_B)
            else:
                logits_BV = self._static_step(tokens_B, pos_B, active_B)
            if self.policy.needs_budget:
                self._budget_pass(active_B)
        if observer is not None:
            for layer, cache in enumerate(self.caches):
                observer(index, layer, cache)
        return logits_BV

    def check(self) -> None:
        for layer, cache in enumerate(self.caches):
            cache.check(f" in layer {layer}")

    # ---- a teacher-forced evaluation --------------------------------------------------------

    def teacher_forced(self, tokens_BS, prefill, lengths_B=None, keep_BL=None, observer=None):
        """``EngineOutput`` of the research loop's protocol (module docstring) for ``B <=
        batch`` sequences; ``prefill``: an int or one per sequence, ``lengths_B``: tokens per
        sequence (default all ``S``), ``keep_BL``: a budgeted policy's entries per head."""
        from stabilitylab.inference.forced import teacher_forced

        return teacher_forced(self, tokens_BS, prefill, lengths_B, keep_BL, observer)
