"""What one cell of the decode benchmark times (``bench.py`` runs the grid and the command).

One decode step of the lab's decoder with random weights, timed at a given context and
compression: every (b, h) row holds ``Binomial(N, 1 - c)`` live entries (a per-head eviction
pattern drawn to the target; rows of a batch differ, as real eviction leaves them), on pages
drawn at random from the pool (as after churn), the key bias of a gate on every entry of the
gated layers. The step writes one entry per row and attends over the live ones (gate-tau at
tau = 0: the gate path runs, nothing is dropped). Measured per (model size, batch, context):

- ``engine`` at each compression: the step (a CUDA graph on CUDA) and its attention alone (the
  layers' kernel calls, also one graph); ``rest = step - attention``; tokens/s = B / step;
  KV bytes of the pages held (``kv_held_bytes``) and of the live entries, against dense.
- anchors, at compression 0, the same model and maths over a contiguous cache
  ``(B, H, N + 1, D)`` per layer, the gate as a key bias: ``sdpa`` (PyTorch SDPA, the bias an
  additive float mask) and ``flex`` (FlexAttention, the bias a ``score_mod``; compiled on CUDA,
  only at ``flex_contexts``; an error is recorded, not raised).

Timing: CUDA events around ``steps`` graph replays, median over ``repeats`` (the cache state is
put back between repeats, so the context does not drift); on CPU ``time.perf_counter``. Numbers
are for the record (docs/BENCHMARKS.md); no test reads them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stabilitylab.config import ModelConfig
from stabilitylab.eviction.decode import project_qkv_BHTD
from stabilitylab.eviction.policies import GateThreshold
from stabilitylab.inference.engine import DecodeEngine
from stabilitylab.inference.layers import _At, inject_gate, paged_attention
from stabilitylab.model import Transformer, rope_cos_sin

SIZES = {
    "reduced": dict(n_layers=6, d_model=384, n_heads=6, d_ff=1536),
    "paper": dict(n_layers=12, d_model=768, n_heads=12, d_ff=3072),
    "smoke": dict(n_layers=2, d_model=32, n_heads=2, d_ff=64),
}
"""The KV study's model shapes (``presets.kv_reduced`` / ``kv_paper``), and a CPU one."""


@dataclass
class BenchConfig:
    sizes: list[str] = field(default_factory=lambda: ["reduced", "paper"])
    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])
    compressions: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 0.9])
    batches: list[int] = field(default_factory=lambda: [1, 32])
    kind: str = "softmax"
    gates: bool = True
    page_size: int = 16
    steps: int = 20
    repeats: int = 5
    vocab: int = 50257
    attention: str = "auto"
    flex_contexts: list[int] = field(default_factory=lambda: [8192, 32768])
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0


# ---- models and caches ------------------------------------------------------------------------


def random_model(size: str, cfg: BenchConfig, positions: int) -> Transformer:
    """The decoder at ``size`` with random weights in ``cfg.dtype``; the gates stay float32
    (``TokenGate`` computes in float32)."""
    torch.manual_seed(cfg.seed)
    mc = ModelConfig(**SIZES[size], dropout=0.0, causal=True, qk_norm="rmsnorm", position="rope",
                     gates=cfg.gates)  # fmt: skip
    backend = "softmax" if cfg.kind == "softmax" else "sigmoid-reference"
    model = Transformer(mc, cfg.vocab, positions, backend).to(cfg.device, cfg.dtype).eval()
    for block in model.blocks:
        if block.gate_out is not None:
            block.gate_out.float()
    return model


def fill(engine: DecodeEngine, N: int, compression: float, gen: torch.Generator) -> None:
    """Every row of every layer: ``Binomial(N, 1 - c)`` live entries on random pages of the
    pool, positions ``0 .. N - 1`` kept in order; the pool's contents are left as they are."""
    for cache in engine.caches:
        cache.reset()
        B, H, M = cache.table_BHM.shape
        P = cache.page_size
        p = torch.full((B, H), 1.0 - compression)
        count_BH = torch.binomial(torch.full((B, H), float(N)), p, generator=gen).long()
        pages_BH = (count_BH + P - 1) // P
        total = int(pages_BH.sum())
        perm = torch.randperm(cache.n_pages, generator=gen)[:total].to(cache.free_F.device)
        taken = torch.arange(M) < pages_BH[..., None]
        cache.table_BHM[taken.to(cache.table_BHM.device)] = perm.to(torch.int32)
        used = torch.zeros(cache.n_pages, dtype=torch.bool, device=perm.device)
        used[perm.long()] = True
        free = torch.nonzero(~used)[:, 0].to(torch.int32)
        cache.free_F[: free.numel()] = free
        cache.n_free.fill_(free.numel())
        cache.held_BH.copy_(pages_BH)
        cache.count_BH.copy_(count_BH)


def fresh_pool(engine: DecodeEngine, gen_device: torch.Generator) -> None:
    """Random K/V in every page (``randn``) and a gate's key bias ``log(g)``, g in (0.01, 1)."""
    for cache in engine.caches:
        cache.k_PSD.normal_(generator=gen_device)
        cache.v_PSD.normal_(generator=gen_device)
        if cache.kb_PS is not None:
            cache.kb_PS.uniform_(math.log(0.01), 0.0, generator=gen_device)


# ---- timing -----------------------------------------------------------------------------------


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], None], steps: int, repeats: int, device, reset=None, graph=True):
    """Median over ``repeats`` of the mean ms of ``steps`` calls of ``fn`` (``reset`` before
    each repeat). On CUDA ``fn`` is captured as a graph (``graph``) after two warm-up calls."""
    cuda = torch.device(device).type == "cuda"
    call = fn
    if cuda and graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn(), fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        if reset is not None:
            reset()
        with torch.cuda.graph(g):
            fn()
        call = g.replay
    out = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        call()  # one untimed call per repeat
        _sync(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                call()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                call()
            out.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(out)


# ---- the engine -------------------------------------------------------------------------------


def kv_facts(engine: DecodeEngine, N: int) -> dict:
    """KV bytes held, live and dense (``N`` entries per row) over the layers."""
    held = sum(c.held_bytes() for c in engine.caches)
    live_entries = sum(int(c.count_BH.sum()) for c in engine.caches)
    per = engine.caches[0].entry_bytes()
    B, H, _ = engine.caches[0].table_BHM.shape
    dense = len(engine.caches) * B * H * N * per
    return {
        "kv_held_bytes": held, "kv_live_bytes": live_entries * per, "kv_dense_bytes": dense,
        "kv_ratio": held / dense, "achieved_compression": 1 - live_entries * per / dense,
    }  # fmt: skip


def attention_only(engine: DecodeEngine, gen_device: torch.Generator) -> Callable[[], None]:
    """Every layer's decode-attention call over its cache as it is, with fixed queries."""
    cfg = engine.model.cfg
    B = engine.batch
    q_LBHD = torch.randn(cfg.n_layers, B, cfg.n_heads, cfg.head_dim, generator=gen_device,
                         device=engine.device).to(engine.caches[0].k_PSD.dtype)  # fmt: skip

    def run() -> None:
        for layer, cache in enumerate(engine.caches):
            paged_attention(cache, q_LBHD[layer], engine.kinds[layer], engine.bias_B, engine.impl)

    return run


def engine_rows(model, cfg: BenchConfig, B: int, N: int, gen: torch.Generator, gen_dev) -> list:
    """One row per compression: the engine's step and attention at context N."""
    room = N + cfg.steps + 8
    engine = DecodeEngine(model, batch=B, max_entries=room, max_position=room + 1,
                          policy=GateThreshold(0.0), page_size=cfg.page_size,
                          attention=cfg.attention)  # fmt: skip
    fresh_pool(engine, gen_dev)
    engine.bias_B.fill_(-math.log(N + 1))
    tokens_B = torch.randint(0, cfg.vocab, (B,), generator=gen).to(engine.device)
    pos_B = torch.full((B,), N, dtype=torch.long, device=engine.device)
    active_B = torch.ones(B, dtype=torch.bool, device=engine.device)
    attend = attention_only(engine, gen_dev)
    rows = []
    for c in cfg.compressions:
        fill(engine, N, c, gen)
        saved = [cache.snapshot() for cache in engine.caches]

        def reset(saved=saved) -> None:
            for cache, state in zip(engine.caches, saved, strict=True):
                cache.restore(state)

        with torch.no_grad():
            step = time_ms(lambda: engine.step(tokens_B, pos_B, active_B), cfg.steps,
                           cfg.repeats, engine.device, reset, graph=False)  # fmt: skip
            attn = time_ms(attend, cfg.steps, cfg.repeats, engine.device, reset)
        reset()
        rows.append({"compression": c, "provider": "engine", "step_ms": step, "attn_ms": attn,
                     **kv_facts(engine, N), "note": engine.impl})  # fmt: skip
    engine.check()
    return rows


# ---- anchors over a contiguous cache ----------------------------------------------------------


def contiguous_step(model, k_L, v_L, kb_B11N, tokens_B, N: int, rope, attend) -> torch.Tensor:
    """The model's step over contiguous caches ``k_L[l] (B, H, N + 1, D)``: the new entry at
    slot N, attention by ``attend(q_BH1D, k, v, kb_B11N)`` over all N + 1 slots."""
    B = tokens_B.shape[0]
    x_B1C, gate_B1 = model.tok_emb(tokens_B[:, None]), None
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        q_BH1D, k_BH1D, v_BH1D = project_qkv_BHTD(attn, block.ln1(x_B1C), _At(rope))
        v_BH1D, _, _ = inject_gate(attn, v_BH1D, gate_B1)
        k_L[layer][:, :, N : N + 1].copy_(k_BH1D)
        v_L[layer][:, :, N : N + 1].copy_(v_BH1D)
        kb = kb_B11N if layer > 0 and model.blocks[layer - 1].gate_out is not None else None
        out_BH1D = attend(q_BH1D, k_L[layer], v_L[layer], kb)
        x_B1C = x_B1C + attn.proj(out_BH1D.transpose(1, 2).reshape(B, 1, -1))
        x_B1C = x_B1C + block.ff(block.ln2(x_B1C))
        gate_B1 = block.gate_out(x_B1C) if block.gate_out is not None else None
    return model.head(model.ln_f(x_B1C[:, 0]))


def sdpa_attend(q, k, v, kb):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=kb)


def flex_attend_fn(device) -> Callable:
    """FlexAttention with the key bias as a score_mod: compiled (a fresh cache per shape) on
    CUDA, eager on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    def attend(q, k, v, kb):
        if kb is None:
            return fn(q, k, v)
        kb_BN = kb[:, 0, 0]
        return fn(q, k, v, score_mod=lambda s, b, h, qi, ki: s + kb_BN[b, ki])

    return attend


def anchor_rows(model, cfg: BenchConfig, B: int, N: int, gen: torch.Generator, gen_dev) -> list:
    """``sdpa`` (and ``flex`` at ``cfg.flex_contexts``) at compression 0."""
    mc, dev, dt = model.cfg, next(model.parameters()).device, cfg.dtype
    shape = (B, mc.n_heads, N + 1, mc.head_dim)
    k_L = [torch.randn(shape, generator=gen_dev, device=dev).to(dt) for _ in model.blocks]
    v_L = [torch.randn(shape, generator=gen_dev, device=dev).to(dt) for _ in model.blocks]
    kb = torch.empty(B, 1, 1, N + 1, device=dev).uniform_(math.log(0.01), 0.0, generator=gen_dev)
    kb = kb.to(dt) if cfg.gates else None
    cos, sin = rope_cos_sin(N + 1, mc.head_dim, mc.rope_base, dev)
    rope = (cos[N][None, None, None], sin[N][None, None, None])
    tokens_B = torch.randint(0, cfg.vocab, (B,), generator=gen).to(dev)
    q_L = [torch.randn(B, mc.n_heads, 1, mc.head_dim, generator=gen_dev, device=dev).to(dt)
           for _ in model.blocks]  # fmt: skip
    providers = {"sdpa": sdpa_attend}
    if N in cfg.flex_contexts:
        providers["flex"] = flex_attend_fn(dev)
    dense = len(model.blocks) * B * mc.n_heads * N * 2 * mc.head_dim * torch.finfo(dt).bits // 8
    rows = []
    for name, attend in providers.items():
        row = {"compression": 0.0, "provider": name, "kv_held_bytes": dense + dense // N,
               "kv_live_bytes": dense, "kv_dense_bytes": dense, "kv_ratio": 1 + 1 / N,
               "achieved_compression": 0.0, "note": ""}  # fmt: skip
        try:
            with torch.no_grad():
                row["step_ms"] = time_ms(
                    lambda a=attend: contiguous_step(model, k_L, v_L, kb, tokens_B, N, rope, a),
                    cfg.steps, cfg.repeats, dev,
                )  # fmt: skip
                row["attn_ms"] = time_ms(
                    lambda a=attend: [a(q, k, v, kb) for q, k, v in zip(q_L, k_L, v_L, strict=True)],
                    cfg.steps, cfg.repeats, dev,
                )  # fmt: skip
        except Exception as e:  # noqa: BLE001  (recorded: "where it runs")
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows.append(row)
    return rows
