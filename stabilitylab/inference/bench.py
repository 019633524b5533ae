"""The decode benchmark's logic (``experiments/bench/bench_decode.py`` is its command line).

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

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
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
COLUMNS = [
    "size", "kind", "batch", "context", "compression", "provider", "step_ms", "attn_ms",
    "rest_ms", "tokens_per_s", "achieved_compression", "kv_held_bytes", "kv_live_bytes",
    "kv_dense_bytes", "kv_ratio", "device", "note",
]  # fmt: skip


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


# ---- the grid, the bars -----------------------------------------------------------------------


def run_grid(cfg: BenchConfig, log: Callable[[str], None] = print) -> pd.DataFrame:
    """Every (size, batch, context): the engine at every compression, then the anchors (after
    the engine's pool is freed: at 32K x 32 the paper's K/V is ~39 GB each)."""
    rows = []
    dev = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    gen_dev = torch.Generator(dev).manual_seed(cfg.seed)
    for size in cfg.sizes:
        model = random_model(size, cfg, max(cfg.contexts) + cfg.steps + 16)
        for B in cfg.batches:
            for N in cfg.contexts:
                base = {"size": size, "kind": cfg.kind, "batch": B, "context": N,
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}  # fmt: skip
                got = engine_rows(model, cfg, B, N, gen, gen_dev)
                gc.collect()  # the engine and its step graph refer to each other
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if cfg.kind == "softmax":
                    got += anchor_rows(model, cfg, B, N, gen, gen_dev)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                rows += [{**base, **r} for r in got]
                log(f"{size} B={B} N={N}: " + ", ".join(
                    f"{r['provider']}@{r['compression']:g} {r.get('step_ms', math.nan):.3f} ms"
                    for r in got))  # fmt: skip
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    df["rest_ms"] = df["step_ms"] - df["attn_ms"]
    df["tokens_per_s"] = df["batch"] / df["step_ms"] * 1e3
    return df


def _bar(name, keys: dict, value: float, threshold: float, higher_is_better: bool) -> dict:
    if value != value:  # NaN: a provider that did not run
        status = "no data"
    else:
        status = (
            "met" if (value >= threshold if higher_is_better else value <= threshold) else "not met"
        )
    return {"bar": name, **keys, "value": value, "threshold": threshold, "status": status}


def _pick(g: pd.DataFrame, provider: str, col: str, c: float = 0.0) -> float:
    return g[(g["provider"] == provider) & (g["compression"] == c)][col].mean()


def bars(df: pd.DataFrame) -> pd.DataFrame:
    """Issue 40's bars, as ratios from this run (NaN stays NaN: ``no data``). The memory bar
    divides the pages held by the live entries' bytes, ``(1 - achieved compression) x dense``:
    what paging costs beyond the live cache."""
    out = []
    for (size, B, N), g in df.groupby(["size", "batch", "context"]):
        keys = {"size": size, "batch": B, "context": N}
        out.append(_bar("sdpa step / engine dense step", keys,
                        _pick(g, "sdpa", "step_ms") / _pick(g, "engine", "step_ms"), 1.0, True))  # fmt: skip
        if N >= 8192 and 0.5 in set(g["compression"]):
            ratio = _pick(g, "engine", "attn_ms", 0.5) / _pick(g, "engine", "attn_ms")
            out.append(_bar("engine attention at 50% / dense", keys, ratio, 0.55, False))
        if N >= 32768 and B >= 32 and 0.5 in set(g["compression"]):
            ratio = _pick(g, "engine", "tokens_per_s", 0.5) / _pick(g, "engine", "tokens_per_s")
            out.append(_bar("engine tokens/s at 50% / dense", keys, ratio, 1.3, True))
        for _, r in g[(g["provider"] == "engine") & (g["compression"] > 0)].iterrows():
            out.append(_bar(f"KV held / live at c = {r['compression']:g}", keys,
                            r["kv_held_bytes"] / r["kv_live_bytes"], 1.05, False))  # fmt: skip
    return pd.DataFrame(out)


def markdown(df: pd.DataFrame, cols: list[str] | None = None) -> str:
    from stabilitylab.analysis.markdown import table

    return table(df if cols is None else df[cols])


TABLE_COLUMNS = ["size", "batch", "context", "compression", "provider", "step_ms", "attn_ms",
                 "rest_ms", "tokens_per_s", "kv_ratio", "note"]  # fmt: skip


# ---- trained cells (--run) --------------------------------------------------------------------


def trained_cells(run_dir, device: str, repeats: int) -> pd.DataFrame:
    """A trained study's gated cells at table2's tau* against tau = 0, through the engine (the
    study's decode-speed table, ``eviction.speed.decode_speed``), on the study's test windows."""
    from pathlib import Path

    from stabilitylab.analysis.kv_study import read_study
    from stabilitylab.eviction.cells import StudyError, load_cells
    from stabilitylab.eviction.speed import check_fingerprints, decode_speed, recorded_selections
    from stabilitylab.eviction.study import study_inputs

    run_dir = Path(run_dir)
    tables = read_study(run_dir / "study")
    missing = [n for n in ("table2", "table5") if n not in tables]
    if missing:
        raise StudyError(f"{run_dir / 'study'}: no {missing}; write the study first")
    gated = list(tables["table2"]["cell"])
    if not gated:
        raise StudyError(f"{run_dir / 'study'}: table2 lists no gated cell")
    cells = load_cells(run_dir, gated, device)
    inputs = study_inputs(next(iter(cells.values())).config, cells)
    selections = recorded_selections(tables["table2"], tables["table5"], inputs.decode, str(run_dir))  # fmt: skip
    check_fingerprints(cells, selections, str(run_dir))
    return decode_speed(cells, selections, inputs, repeats=repeats, alone=True)


# ---- the command ------------------------------------------------------------------------------


def smoke_config(out_device: str = "cpu") -> BenchConfig:
    """Every code path on a CPU in seconds: a 2 x 32 decoder, context 48, batches 1 and 2,
    every compression, PyTorch attention (``--attention triton`` with TRITON_INTERPRET=1
    takes the kernel, slowly)."""
    return BenchConfig(
        sizes=["smoke"], contexts=[48], batches=[1, 2], steps=1, repeats=1, vocab=64,
        attention="reference", flex_contexts=[48], device=out_device, dtype=torch.float32,
    )  # fmt: skip


def parse(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Decode speed of the engine against SDPA / Flex.")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run (seconds), every path")
    p.add_argument("--out", default="runs/bench_decode", help="output folder (CSV, markdown)")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), help="model sizes")
    p.add_argument("--contexts", nargs="+", type=int, help="live context N before compression")
    p.add_argument("--compressions", nargs="+", type=float, help="fractions evicted, in [0, 1)")
    p.add_argument("--batches", nargs="+", type=int, help="batch sizes")
    p.add_argument("--kind", choices=["softmax", "sigmoid"], help="attention (sigmoid: no anchors)")
    p.add_argument("--no-gates", action="store_true", help="a model without gates")
    p.add_argument("--steps", type=int, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, help="repeats (the median is reported)")
    p.add_argument("--page-size", type=int, help="entries per page")
    p.add_argument("--attention", choices=["auto", "triton", "reference"])
    p.add_argument("--flex-contexts", nargs="*", type=int, help="contexts with a Flex anchor")
    p.add_argument("--run", help="a trained KV study's run dir: its gated cells at tau*")
    return p, p.parse_args(argv)


def config_from(args) -> BenchConfig:
    cfg = smoke_config() if args.smoke else BenchConfig()
    over = {"sizes": args.sizes, "contexts": args.contexts, "compressions": args.compressions,
            "batches": args.batches, "kind": args.kind, "steps": args.steps,
            "repeats": args.repeats, "page_size": args.page_size, "attention": args.attention,
            "flex_contexts": args.flex_contexts}  # fmt: skip
    for k, v in over.items():
        if v is not None:
            setattr(cfg, k, v)
    cfg.gates = cfg.gates and not args.no_gates
    return cfg


def check_config(cfg: BenchConfig) -> str | None:
    """The first problem with ``cfg``, or None."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device: run with --smoke on a CPU"
    if any(not 0 <= c < 1 for c in cfg.compressions):
        return f"--compressions must lie in [0, 1), got {cfg.compressions}"
    if any(n < 1 for n in [*cfg.contexts, *cfg.batches, cfg.steps, cfg.repeats, cfg.page_size]):
        return "--contexts, --batches, --steps, --repeats and --page-size must be >= 1"
    return None


def main(argv=None) -> int:
    from pathlib import Path

    from stabilitylab.runs import provenance, write_json

    p, args = parse(argv)
    cfg = config_from(args)
    if args.smoke:  # tiny models on a small shared CPU: one thread is several times faster
        torch.set_num_threads(1)
    problem = check_config(cfg)
    if problem:
        print(f"error: {problem}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df = run_grid(cfg)
    df.to_csv(out / "decode.csv", index=False)
    bar = bars(df)
    bar.to_csv(out / "decode_bars.csv", index=False)
    parts = ["# Decode: engine vs SDPA / Flex", "", markdown(df, TABLE_COLUMNS), "",
             "## Bars", "", markdown(bar)]  # fmt: skip
    if args.run:
        cells = trained_cells(args.run, cfg.device, cfg.repeats)
        cells.to_csv(out / "cells.csv", index=False)
        parts += ["", "## Trained cells at tau*", "", markdown(cells)]
    (out / "decode.md").write_text("\n".join(parts) + "\n")
    write_json(out / "provenance.json", {**provenance(), "config": {k: str(v) for k, v in vars(cfg).items()}})  # fmt: skip
    print("\n".join(parts))
    return 0
