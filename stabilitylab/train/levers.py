"""Speed levers of the training step and a rig that steps one arm with a chosen set of them.

The benchmark (``experiments/bench/bench_model.py``) and the profiler
(``experiments/bench/profile_step.py``) both step through :class:`StepRig`, the trainer's step
(``stabilitylab.train.step``) reduced to one micro-batch: forward under bf16 autocast on CUDA,
summed masked-token loss over the labelled count, backward, global grad norm, ``found_inf``, fused
AdamW, ``zero_grad``, one host read. Its phases are marked with ``record_function`` (``forward``,
``loss``, ``backward``, ``optimizer``) for ``stabilitylab.analysis.step_profile``.

Levers (a variant is ``eager``, one lever alone, ``all`` of ``LEVERS``, or levers joined by
``+``, e.g. ``compile+mb8``; ``all`` may be one of them: ``all+autotune``):

- ``compile``: ``model.compile(fullgraph=True, dynamic=False)`` (static shapes: a batch of
  another size is another graph, never a symbolic one); a graph break falls back to
  ``fullgraph=False`` with the break's reason in ``StepRig.compile_note``. Dropout then draws
  other random numbers (inductor's RNG): the same function, another sample.
- ``compile-blocks``: each block compiled alone (``fullgraph=True``), the embeddings, final norm
  and head eager: the L identical blocks share one compiled graph, so it compiles about L times
  faster than the whole model; it gives up fusing across block boundaries.
- ``compile-cg``: ``compile`` with inductor's ``mode="reduce-overhead"``: the compiled forward
  and backward replayed as CUDA graphs (static shapes, so the launches and the host gap between
  them go); on CPU, or with another backend than inductor, the same as ``compile``.
- ``mb8``: eight sequences per micro-batch (the per-sequence figures compare): the idle gap
  before each micro-batch, the accumulation's adds and the copies are shared by eight sequences;
  25-26 GiB at stress_8k. ``mb2`` and ``mb4``, its alternatives, two and four (the largest named
  wins).
- ``chunked-ce``: ``stabilitylab.chunked_loss.linear_cross_entropy_sum`` on the final norm's
  output: no full logits; the same loss to rounding. The labelled rows are counted once at
  build on the host, as the trainer's batches count them, so the step does not wait for them.
  On CUDA each chunk's loss and logit gradient come from one Triton kernel
  (``kernels/cross_entropy.py``).
- ``no-copies``: the q/k/v gradient assembled in one pass (``model.split_qkv_heads``); the same
  values bit for bit. The Triton kernels already take the strided q/k/v views and write their
  output in the layout the output projection reads.
- ``pad-vocab``: the head's GEMMs on its rows padded to a multiple of ``HEAD_ROW_MULTIPLE``
  (``Transformer.set_head_row_multiple``, and ``row_multiple`` of the chunked loss): V = 44,003
  is odd and cuBLAS runs it on alignment-1 kernels. The same function; parameters and checkpoints
  unchanged.
- ``accum``: ``ACCUM_MICRO_BATCHES`` micro-batches (forward and backward, gradients summed) per
  optimizer step, as the trainer takes a global batch larger than the micro-batch (the paper's
  256 sequences on one to 16 GPUs: 16-256 micro-batches of one or two). The optimizer, the grad
  norm and the step's one host read are paid once per optimizer step; per-sequence figures
  compare. Not a change to the step's maths: the eager trainer at the paper's batch does it too.
- ``autotune`` (an alternative to ``compile``): compiled with inductor's
  ``mode="max-autotune-no-cudagraphs"``: its GEMMs chosen by timing Triton templates against
  cuBLAS, a template's epilogue fusing the elementwise work after it (bias, GELU); minutes of
  compile.

Deterministic variants (not speed levers; measured beside the default): ``det`` is ``eager`` and
``det-all`` is ``all``, each stepped under ``torch.use_deterministic_algorithms(True)`` as
``train.deterministic`` runs (the Triton kernels launch their pinned configs), with the
backend ``train.deterministic`` would pick (``deterministic_backend``: softmax's SDPA becomes
softmax-triton on CUDA); the mode is on for that rig's own steps only. A rig's label names the
backend that ran: ``softmax-triton / det``.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from stabilitylab.attention import compiled_lengths_hint
from stabilitylab.chunked_loss import linear_cross_entropy_sum
from stabilitylab.config import NOT_DETERMINISTIC, Config, deterministic_softmax
from stabilitylab.determinism import deterministic_mode, set_cublas_workspace
from stabilitylab.model import (
    HEAD_ROW_MULTIPLE,
    Transformer,
    masked_lm_loss_sum,
    vocab_size_for,
)
from stabilitylab.telemetry import LayerStatsMonitor, LogitMonitor, global_grad_norm
from stabilitylab.train.build import make_optimizer
from stabilitylab.train.fast import failure_reason, raise_recompile_limit

LEVERS = ("compile", "mb8", "chunked-ce", "no-copies", "pad-vocab", "accum")
ALTERNATIVES = ("compile-blocks", "compile-cg", "autotune", "coord", "mb2", "mb4")
"""Variants measured alone but not part of ``all`` (another form of a lever in ``LEVERS``)."""
DETERMINISTIC = "det"
"""The mode of the deterministic variants (module docstring), carried in a rig's levers."""
DETERMINISTIC_VARIANTS = {"det": "eager", "det-all": "all"}
"""Each deterministic variant and the variant whose levers it takes."""
COMPILED = frozenset({"compile", "compile-blocks", "compile-cg", "autotune", "coord"})
"""The levers that compile the model."""
VARIANTS = ("eager", *LEVERS, *ALTERNATIVES, "all", *DETERMINISTIC_VARIANTS)
"""The named variants; levers joined by ``+`` are variants too (``variant_levers``)."""
ACCUM_MICRO_BATCHES = 8
"""``accum``: micro-batches per optimizer step (fewer than the paper's batch needs on 16 GPUs)."""


def variant_levers(variant: str) -> frozenset[str]:
    """The levers a variant turns on: none (``eager``), one, every one (``all``), or those joined
    by ``+`` (each a lever, an alternative or ``all``); the deterministic variants add
    ``DETERMINISTIC`` to ``eager``'s or ``all``'s."""
    if "+" in variant:
        parts = variant.split("+")
        for p in parts:
            if p not in (*LEVERS, *ALTERNATIVES, "all"):
                raise ValueError(
                    f"unknown lever {p!r} in variant {variant!r}; join levers from "
                    f"{[*LEVERS, *ALTERNATIVES, 'all']} with '+'"
                )
        levers = frozenset().union(*(variant_levers(p) for p in parts))
        if "coord" in levers and levers & {"compile-cg", "autotune"}:
            raise ValueError(f"variant {variant!r}: 'coord' cannot join 'compile-cg' or 'autotune'")
        return levers
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")
    if variant in DETERMINISTIC_VARIANTS:
        return variant_levers(DETERMINISTIC_VARIANTS[variant]) | {DETERMINISTIC}
    if variant == "eager":
        return frozenset()
    return frozenset(LEVERS) if variant == "all" else frozenset({variant})


def micro_batch_factor(levers: frozenset[str]) -> int:
    """How many times the caller's micro-batch a rig's batch holds: the largest of ``mb8``,
    ``mb4``, ``mb2`` named (8, 4, 2), else 1."""
    return next((f for f in (8, 4, 2) if f"mb{f}" in levers), 1)


def deterministic_backend(backend: str, cuda: bool) -> str:
    """The backend an arm runs with under ``train.deterministic``: one that may differ run to
    run (``config.NOT_DETERMINISTIC``: SDPA, FlexAttention) gives way to softmax-triton on CUDA,
    softmax-reference on CPU, as ``Config.backend_for`` picks; the others stay."""
    if backend not in NOT_DETERMINISTIC:
        return backend
    return deterministic_softmax(cuda)


def parse_variants(names: list[str]) -> list[str]:
    """Variants in the order given, each once; an unknown name raises, naming it."""
    for n in names:
        variant_levers(n)
    return list(dict.fromkeys(names))


def prepare_variants(names: list[str]) -> list[str]:
    """``parse_variants``, and when one of them is deterministic the cuBLAS workspace that
    ``train.deterministic`` sets (before the process's first matmul): the benchmarks' start."""
    variants = parse_variants(names)
    if any(DETERMINISTIC in variant_levers(v) for v in variants):
        set_cublas_workspace()
    return variants


def cli_variants(names: list[str], script: str, need_cuda: bool = True) -> list[str]:
    """``prepare_variants`` for a benchmark's command line: an unknown variant, or (with
    ``need_cuda``) a machine without CUDA, exits with one ``error:`` line naming it (``script``
    names the benchmark)."""
    try:
        variants = prepare_variants(names)
    except ValueError as e:
        raise SystemExit(f"error: --variants: {e}") from None
    if need_cuda and not torch.cuda.is_available():
        raise SystemExit(f"error: {script} needs a CUDA GPU")
    return variants


def synthetic_batch(B: int, T: int, vocab: int, device, seed: int = 0):
    """Full-length rows of random tokens, 15% of positions labelled: ``(tokens, lengths, labels)``
    (the masked-token task's shapes at the stress setting). Row r is drawn from seed + r alone, so
    a larger batch extends a smaller one, and any device gets the same numbers."""
    rows = []
    for r in range(B):
        g = torch.Generator().manual_seed(seed + r)
        tokens_T = torch.randint(3, vocab, (T,), generator=g)
        rows.append((tokens_T, torch.where(torch.rand(T, generator=g) < 0.15, tokens_T, -100)))
    tokens_BT = torch.stack([t for t, _ in rows])
    labels_BT = torch.stack([y for _, y in rows])
    lengths_B = torch.full((B,), T, dtype=torch.long)
    return tokens_BT.to(device), lengths_B.to(device), labels_BT.to(device)


@dataclass
class StepRig:
    """One arm with one variant: model, optimizer, a fixed batch, and ``step``."""

    label: str
    model: Transformer
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    levers: frozenset[str]
    n_labelled: int
    """The batch's labelled positions, counted on the host when it was built, as the trainer's
    batches carry them: the loss's denominator, and ``chunked-ce`` selects them without a host
    sync."""
    micro_batches: int = 1
    """Micro-batches (each ``batch``) per optimizer step (``accum``)."""
    compile_note: str = ""
    logit_mon: LogitMonitor = field(default_factory=lambda: LogitMonitor(1))
    layer_mon: LayerStatsMonitor = field(default_factory=lambda: LayerStatsMonitor(1))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    @property
    def device(self) -> torch.device:
        return self.batch[0].device

    def mode(self):
        """The deterministic mode around this rig's steps (on for ``det`` variants; else the
        process's mode, untouched)."""
        return deterministic_mode(True) if DETERMINISTIC in self.levers else nullcontext()

    def loss(self) -> torch.Tensor:
        """Mean masked-token loss of the batch (forward and loss phases), float32."""
        tokens_BT, lengths_B, labels_BT = self.batch
        cuda = self.device.type == "cuda"
        hidden = "chunked-ce" in self.levers
        if "compile-cg" in self.levers and cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are done
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            with record_function("forward"), compiled_lengths_hint(lengths_B, tokens_BT.shape[1]):
                out = self.model(tokens_BT, lengths_B, return_hidden=hidden)
            with record_function("loss"):
                if hidden:
                    head = self.model.head
                    total = linear_cross_entropy_sum(
                        out, head.weight, head.bias, labels_BT, row_multiple=head.row_multiple,
                        n_labelled=self.n_labelled,
                    )  # fmt: skip
                else:
                    total = masked_lm_loss_sum(out, labels_BT)
                return total / self.n_labelled

    def step(self, record_logits=False, layer_stats=False, grad_norm=True) -> torch.Tensor:
        """One optimizer step as the trainer takes it, telemetry chosen, in the rig's ``mode``;
        returns the loss."""
        with self.mode():
            return self._step(record_logits, layer_stats, grad_norm)

    def _step(self, record_logits, layer_stats, grad_norm) -> torch.Tensor:
        model, opt = self.model, self.optimizer
        if record_logits:
            self.logit_mon.attach(model)
        k = self.micro_batches
        loss = torch.zeros((), device=self.device)
        for _ in range(k):  # the gradient of the mean over micro-batches, summed into .grad
            loss_i = self.loss() / k
            with record_function("backward"):
                loss_i.backward()
            loss = loss + loss_i.detach()
        with record_function("optimizer"):
            if record_logits:
                self.logit_mon.collect(model)
            loss_gn = None
            if grad_norm:
                gn = global_grad_norm(self.params)
                loss_gn = torch.stack([loss.detach().float(), gn])
                opt.found_inf = (~torch.isfinite(loss_gn).all()).float()
            else:
                opt.found_inf = None
            if layer_stats:
                self.layer_mon.before_step(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if loss_gn is not None:
                loss_gn.tolist()  # the trainer's one host read per step, after the update is queued
            if record_logits:
                self.logit_mon.detach(model).tolist()
            if layer_stats:
                self.layer_mon.after_step(model).tolist()
        return loss.detach()


def build_rig(
    cfg: Config,
    backend: str,
    variant: str,
    device,
    micro_batch: int = 1,
    compile_backend: str = "inductor",
) -> StepRig:
    """The arm ``backend`` at ``cfg``'s model and context with ``variant``'s levers. Every
    variant of an arm starts from the same weights (seed 0) and, per sequence, the same batch.
    A deterministic variant runs ``deterministic_backend(backend)``, named in the label."""
    levers = variant_levers(variant)
    if DETERMINISTIC in levers:
        backend = deterministic_backend(backend, torch.device(device).type == "cuda")
    T, vocab = cfg.data.context_len, vocab_size_for(cfg.data.n_genes)
    torch.manual_seed(0)
    model = Transformer(cfg.model, vocab, T, backend).to(device)
    model.set_one_pass_qkv_grad("no-copies" in levers)
    model.set_head_row_multiple(HEAD_ROW_MULTIPLE if "pad-vocab" in levers else 1)
    B = micro_batch * micro_batch_factor(levers)
    batch = synthetic_batch(B, T, vocab, device)
    rig = StepRig(
        label=f"{backend} / {variant}",
        model=model,
        optimizer=make_optimizer(cfg, model),
        batch=batch,
        levers=levers,
        n_labelled=int((batch[2] != -100).sum()),  # once, at build (a sync outside the steps)
        micro_batches=ACCUM_MICRO_BATCHES if "accum" in levers else 1,
    )
    if levers & COMPILED:
        rig.compile_note = _compile_checked(rig, compile_backend)
    return rig


def _compile_checked(rig: StepRig, compile_backend: str) -> str:
    """Compile ``rig.model`` with ``fullgraph=True`` and trace it once (forward and backward,
    no update); on a graph break recompile with ``fullgraph=False``. Returns a note: the mode,
    the first break's reason if any, and the seconds the first traced step took."""
    model = rig.model
    targets = list(model.blocks) if "compile-blocks" in rig.levers else [model]
    raise_recompile_limit()
    t0 = time.perf_counter()
    with rig.mode():
        note = _compile_traced(rig, targets, compile_backend)
    model.zero_grad(set_to_none=True)
    return f"{note}; first traced step {time.perf_counter() - t0:.1f} s"


def _compile_traced(rig: StepRig, targets: list[torch.nn.Module], compile_backend: str) -> str:
    """Compile ``targets`` (fullgraph, else with breaks) and trace one forward and backward."""
    kw = {"backend": compile_backend}
    if compile_backend == "inductor" and rig.device.type == "cuda":
        if "compile-cg" in rig.levers:
            kw["mode"] = "reduce-overhead"
        elif "autotune" in rig.levers:
            kw["mode"] = "max-autotune-no-cudagraphs"
        elif "coord" in rig.levers:
            kw["options"] = {"coordinate_descent_tuning": True}
    try:
        for m in targets:
            m.compile(fullgraph=True, dynamic=False, **kw)
        rig.loss().backward()
        note = "fullgraph"
    except Exception as e:  # torch._dynamo's Unsupported / UserError, whatever the version
        reason = failure_reason(e)
        print(f"compile {rig.label}: fullgraph=True failed ({reason}); "
              "falling back to fullgraph=False")  # fmt: skip
        for m in targets:
            m.compile(dynamic=False, **kw)
        rig.loss().backward()
        note = f"graph breaks ({reason})"
    return note
