"""Causal gated attention on one GPU: the fused gated sigmoid kernel against the softmax options.

    python experiments/bench/bench_causal.py --out runs/bench_causal          # ~3 min, one H200
    python experiments/bench/bench_causal.py --profile --out runs/bench_causal  # where the time goes
    TRITON_INTERPRET=1 python experiments/bench/bench_causal.py --smoke [--profile] --out runs/smoke

Shapes: bf16, head dim 64, 16,384 tokens per batch (B = 16384 / T), T = 512, 1024, 2048, 8192 (the
KV study trains at 512), no padding, H = hidden / 64 heads with hidden 768 (12 heads, GPT-2 small; ``--hidden``). TFLOPS over
the causal half: forward 4 H D sum_b T (T + 1) / 2, backward 2.5x forward; times are
``triton.testing.do_bench`` medians, every provider timed once per round, rounds interleaved.
"Gated" = the KV-eviction gate g in (0, 1) per key, both halves inside the timed region and its
gradient in the backward: log(g + 1e-8) added to every query's logit for that key, g * v on the
values. Providers:

- ``sigmoid-gated``: the lab's fused kernel, causal with ``key_bias_BT`` (gate on), as the model
  calls it today
- ``sigmoid-fused-gate``: the same kernel given the gate itself (``gate_BT``, opt-in): log g and
  g * v inside the kernels, the gate's gradient out of the dK/dV kernel, no elementwise kernels
- ``sigmoid``: the same kernel, causal, no gate (gate off)
- ``sigmoid-bias``, ``sigmoid-gv``: the gate's cost taken apart: the kernel with the key bias
  ``log(g + 1e-8)`` alone (its loads and its gradient's row sums, v unscaled), and the kernel with
  no bias after the elementwise ``g * v`` alone (its multiply and gradient outside the kernel)
- ``cudnn``, ``flash``: SDPA causal softmax (``is_causal=True``), no gate
- ``flex-gated``: compiled FlexAttention, causal block mask, a ``score_mod`` adding the key bias
- ``sdpa-gated``: SDPA with the gate as an additive float mask (B, 1, T, T), -inf above the
  diagonal, built per call as a model builds it per layer (the lab's ``softmax`` backend)
- ``eager-gated``: the PyTorch reference (n x n scores), causal with the key bias

Bars (issue 41; medians of per-round TFLOPS ratios, forward and backward): gate off (sigmoid)
>= 0.9x cudnn from T = 1024, 0.8x at 512; sigmoid-gated >= 1.0x flex-gated at every T; the gate
costs at most 15% from T = 2048 (sigmoid-gated >= sigmoid / 1.15); the same two for
sigmoid-fused-gate; and which gated softmax is faster, sdpa-gated or flex-gated. For scale, on an H200 (16K tokens, hd 64):
cuDNN causal 383 / 327 TFLOPS (fwd / bwd) at 2K and 457 / 421 at 8K; FlexAttention causal with a
per-key bias 285 / 230 and 340 / 277. Writes ``causal.csv`` (one row per provider, T and round),
``causal_bars.csv`` and ``causal.md`` under ``--out``; prints the table and the bars last.
``--smoke``: tiny shapes, one timed call each; on CPU (Triton's interpreter) the CUDA-only
providers are left out. It checks that the script runs, not speed.

``--profile`` (instead of the TFLOPS table): per T and provider (default ``PROFILE_PROVIDERS``:
gate on, the gate in the kernel, gate off, cuDNN), ``--calls`` forward calls and as many backward calls under
``torch.profiler``, each ended by a device sync, split by stabilitylab/analysis/causal_profile.py
into the attention kernels, the gate's elementwise work (log g, g * v, each with its gradient),
the key bias's sum over heads, the op's other kernels, other kernels, and the host / launch time
(before the first kernel, idle between kernels, the sync's tail), us per call, beside the same
calls' unprofiled wall and host medians. Writes ``causal_profile.md`` / ``.csv`` and
``causal_profile_kernels.csv`` (every kernel with its role) and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import time
from collections.abc import Callable

import pandas as pd
import torch
import torch.nn.functional as F
import triton

from stabilitylab.analysis import causal_profile as cp
from stabilitylab.analysis.bench_report import markdown_table
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.reference import sigmoid_attention_reference

PROVIDERS = ["sigmoid-gated", "sigmoid-fused-gate", "sigmoid", "sigmoid-bias", "sigmoid-gv",
             "cudnn", "flash", "flex-gated", "sdpa-gated", "eager-gated"]  # fmt: skip
CUDA_ONLY = {"cudnn", "flash", "flex-gated"}
OP, FUSED, GATE_OFF = "sigmoid-gated", "sigmoid-fused-gate", "sigmoid"
FLEX, SDPA = "flex-gated", "sdpa-gated"
# Issue 41's bars: (bar, numerator, denominator, (from T, threshold on the TFLOPS ratio) steps).
# Gate off at least 0.9x cuDNN from 1K (0.8x at 512); gate on at least Flex gated at every T; the
# gate costs at most 15% in time against gate off from 2K.
BARS = [
    ("gate off / cudnn", GATE_OFF, "cudnn", ((512, 0.8), (1024, 0.9))),
    ("sigmoid-gated / flex-gated", OP, FLEX, ((512, 1.0),)),
    ("gate on / gate off", OP, GATE_OFF, ((2048, 1 / 1.15),)),
    ("sigmoid-fused-gate / flex-gated", FUSED, FLEX, ((512, 1.0),)),
    ("fused gate on / gate off", FUSED, GATE_OFF, ((2048, 1 / 1.15),)),
]
HEAD_DIM = 64
SEQ_LENS = (512, 1024, 2048, 8192)


def causal_flops_fwd(B: int, H: int, D: int, T: int) -> float:
    """Forward FLOPs over the causal half: two products of 2 D flops per visible pair."""
    return 4.0 * H * D * B * T * (T + 1) / 2


def make_inputs(tokens: int, hidden: int, T: int, device: str, dtype: torch.dtype) -> dict:
    """q, k, v (B, H, T, D) and the gate g (B, T), all leaves that require grad, lengths full."""
    B, H = max(1, tokens // T), hidden // HEAD_DIM
    g = torch.Generator(device).manual_seed(T)
    qkv = [torch.randn(B, H, T, HEAD_DIM, generator=g, device=device, dtype=dtype)
           for _ in range(3)]  # fmt: skip
    gate = torch.rand(B, T, generator=g, device=device) * 0.98 + 0.01
    leaves = [t.requires_grad_() for t in (*qkv, gate)]
    lengths = torch.full((B,), T, dtype=torch.int32, device=device)
    return {"q": leaves[0], "k": leaves[1], "v": leaves[2], "gate": leaves[3], "lengths": lengths}


_RANGES = False
"""Whether ``marked`` opens profiler ranges (``--profile``); off, timed calls carry none."""


def marked(name: str):
    """A ``record_function`` range named ``name`` while profiling, else nothing."""
    return torch.autograd.profiler.record_function(name) if _RANGES else contextlib.nullcontext()


def gate_halves(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's two halves as a model applies them: ``(key_bias_BT, g * v)``."""
    gate = x["gate"]
    with marked(cp.LOG_G_RANGE):
        kb = torch.log(gate + 1e-8)
    with marked(cp.GV_RANGE):
        gv = x["v"] * gate[:, None, :, None].to(x["v"].dtype)
    return kb, gv


def _sigmoid_gated(x: dict) -> torch.Tensor:
    kb, v = gate_halves(x)
    out_BHTD, _ = sigmoid_attention(x["q"], x["k"], v, x["lengths"], causal=True, key_bias_BT=kb)
    return out_BHTD


def _sigmoid_fused_gate(x: dict) -> torch.Tensor:
    return sigmoid_attention(x["q"], x["k"], x["v"], x["lengths"], causal=True,
                             gate_BT=x["gate"])[0]  # fmt: skip


def _gate_half(bias: bool) -> Callable:
    """The fused kernel with one half of the gate: the key bias in the kernel, or ``g * v``."""

    def run(x):
        kb, gv = gate_halves(x)
        v, key_bias = (x["v"], kb) if bias else (gv, None)
        return sigmoid_attention(
            x["q"], x["k"], v, x["lengths"], causal=True, key_bias_BT=key_bias
        )[0]

    return run


def _sdpa(backend) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def run(x):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)

    return run


def _flex_gated(x: dict) -> Callable:
    """Compiled FlexAttention with a causal block mask (built once per shape) and the key bias as
    a score_mod; a fresh dynamo cache per shape (past its recompile limit dynamo falls back to the
    unfused eager path)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    B, _, T, _ = x["q"].shape
    causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    block_mask = create_block_mask(causal, B, None, T, T, device=x["q"].device)

    def run(x):
        kb, v = gate_halves(x)
        score_mod = lambda score, b, h, q_idx, kv_idx: score + kb[b, kv_idx]
        return flex(x["q"], x["k"], v, score_mod=score_mod, block_mask=block_mask)

    return run


def _sdpa_gated(x: dict) -> Callable:
    T = x["q"].shape[2]
    below_TT = torch.ones(T, T, dtype=torch.bool, device=x["q"].device).tril()

    def run(x):
        kb, v = gate_halves(x)
        mask = torch.where(below_TT, kb[:, None, None, :].to(v.dtype), float("-inf"))
        return F.scaled_dot_product_attention(x["q"], x["k"], v, attn_mask=mask)

    return run


def provider_fn(name: str, x: dict) -> Callable[[dict], torch.Tensor] | None:
    """The forward of ``name`` on inputs ``x``, or None where it cannot run (no CUDA; an n x n
    eager reference too large)."""
    from torch.nn.attention import SDPBackend

    B, H, T, _ = x["q"].shape
    if name in CUDA_ONLY and not x["q"].is_cuda:
        return None
    if name == OP:
        return _sigmoid_gated
    if name == FUSED:
        return _sigmoid_fused_gate
    if name == GATE_OFF:
        return lambda x: sigmoid_attention(x["q"], x["k"], x["v"], x["lengths"], causal=True)[0]
    if name in ("sigmoid-bias", "sigmoid-gv"):
        return _gate_half(bias=name == "sigmoid-bias")
    if name in ("cudnn", "flash"):
        return _sdpa(SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION)
    if name == FLEX:
        return _flex_gated(x)
    if name == SDPA:
        return _sdpa_gated(x)
    if name == "eager-gated":
        if B * H * T * T > 2**32:
            return None  # its n x n scores and their gradients would not fit comfortably

        def eager(x):
            kb, v = gate_halves(x)
            return sigmoid_attention_reference(
                x["q"], x["k"], v, x["lengths"], causal=True, key_bias_BT=kb
            )

        return eager
    raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")


def time_ms(fn: Callable[[], object], smoke: bool) -> float:
    """``do_bench`` median in ms; in a smoke run one call timed on the host clock (no CUDA events
    on CPU, and the interpreter is slow)."""
    if not smoke:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def time_provider(fwd, x: dict, smoke: bool) -> tuple[float, float]:
    """Forward and backward ms of ``fwd`` (the backward: gradients of q, k, v and, for the gated
    providers, of the gate through both of its halves); NaN where ``fwd`` is None."""
    if fwd is None:
        return float("nan"), float("nan")
    out = fwd(x)  # compile / autotune outside the timed region
    ms_f = time_ms(lambda: fwd(x), smoke)
    leaves = [x["q"], x["k"], x["v"], x["gate"]]
    g = torch.randn_like(out)
    grad = lambda: torch.autograd.grad(out, leaves, g, retain_graph=True, allow_unused=True)
    grad()
    return ms_f, time_ms(grad, smoke)


def _failed(name: str, T: int, e: Exception) -> None:
    print(f"  {name} T={T}: {type(e).__name__}: {str(e)[:160]}", flush=True)


def bench(args, device: str, dtype: torch.dtype) -> pd.DataFrame:
    """Shapes outermost, then rounds, then providers: within a round every provider runs on the
    same inputs one after another, so per-round ratios compare them under the same conditions.
    One CSV row is appended per measurement, so a run cut off keeps its rows."""
    rows, csv = [], os.path.join(args.out, "causal.csv")
    if os.path.exists(csv):
        os.remove(csv)
    for T in args.seq_lens:
        x = make_inputs(args.tokens, args.hidden, T, device, dtype)
        B, H = x["q"].shape[:2]
        flops = causal_flops_fwd(B, H, HEAD_DIM, T)
        fns = {}
        for name in args.providers:
            try:  # flex compiles here, once per shape
                fns[name] = provider_fn(name, x)
            except Exception as e:  # a provider that cannot run a shape is a row of NaN
                _failed(name, T, e)
                fns[name] = None
        for rnd in range(args.rounds):
            for name in args.providers:
                try:
                    ms_f, ms_b = time_provider(fns[name], x, args.smoke)
                except Exception as e:
                    _failed(name, T, e)
                    ms_f = ms_b = float("nan")
                row = {
                    "provider": name, "T": T, "B": B, "H": H, "D": HEAD_DIM, "round": rnd,
                    "fwd_ms": ms_f, "bwd_ms": ms_b, "fwd_tflops": flops / ms_f * 1e-9,
                    "bwd_tflops": 2.5 * flops / ms_b * 1e-9,
                }  # fmt: skip
                rows.append(row)
                pd.DataFrame([row]).to_csv(csv, mode="a", header=len(rows) == 1, index=False)
                print(f"{name:18s} T={T:5d} round {rnd} fwd {row['fwd_tflops']:6.1f} "
                      f"bwd {row['bwd_tflops']:6.1f} TFLOPS", flush=True)  # fmt: skip
        del x, fns
        if device == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per T, one "fwd / bwd" TFLOPS column per provider: medians over rounds."""
    med = df.groupby(["provider", "T"], sort=False, as_index=False)[
        ["fwd_tflops", "bwd_tflops"]
    ].median()
    med["cell"] = [f"{f:.0f} / {b:.0f}".replace("nan", "-")
                   for f, b in zip(med.fwd_tflops, med.bwd_tflops, strict=True)]  # fmt: skip
    wide = med.pivot_table(index="T", columns="provider", values="cell", aggfunc="first")
    return wide[list(dict.fromkeys(df.provider))].reset_index()


def ratio_row(bar: str, T: int, num: pd.Series, den: pd.Series, threshold: float) -> dict:
    """Per-round ratios ``num / den`` (both indexed by round; rounds missing either are left out):
    median, range, and ``met`` when every round reaches ``threshold``, ``tie`` when only the
    median does, ``not met`` else, ``no data`` without a round."""
    ratios = (num / den.reindex(num.index)).dropna()
    if ratios.empty:
        return {"bar": bar, "T": T, "threshold": threshold, "rounds": 0, "median": float("nan"),
                "low": float("nan"), "high": float("nan"), "status": "no data"}  # fmt: skip
    median, passing = float(ratios.median()), int((ratios >= threshold).sum())
    status = "met" if passing == len(ratios) else "tie" if median >= threshold else "not met"
    return {"bar": bar, "T": T, "threshold": threshold, "rounds": len(ratios), "median": median,
            "low": float(ratios.min()), "high": float(ratios.max()), "status": status}  # fmt: skip


def bar_threshold(steps: tuple[tuple[int, float], ...], T: int, every_t: bool) -> float | None:
    """A bar's threshold at ``T``: that of its last step starting at or below T; below its first
    step None (the bar does not apply), or with ``every_t`` (a smoke run's tiny T) the first's."""
    applicable = [threshold for start, threshold in steps if start <= T]
    if applicable:
        return applicable[-1]
    return steps[0][1] if every_t else None


def bars(df: pd.DataFrame, every_t: bool = False) -> pd.DataFrame:
    """The bars (``BARS``) at each T where they apply (``bar_threshold``), forward and backward,
    and at every T the gated softmax comparison (sdpa-gated / flex-gated TFLOPS: above 1 the
    float mask is faster)."""
    per = df.set_index(["provider", "T", "round"]).sort_index()
    series = lambda name, T, col: (
        per.loc[(name, T)][col] if (name, T) in per.index.droplevel("round") else pd.Series()
    )
    rows = []
    for T in sorted(df["T"].unique()):
        for kind in ("fwd", "bwd"):
            col = f"{kind}_tflops"
            for bar, num, den, steps in BARS:
                threshold = bar_threshold(steps, T, every_t)
                if threshold is None:
                    continue
                rows.append(ratio_row(f"{kind} {bar}", T, series(num, T, col),
                                      series(den, T, col), threshold))  # fmt: skip
            row = ratio_row(f"{kind} {SDPA} / {FLEX}", T, series(SDPA, T, col),
                            series(FLEX, T, col), 1.0)  # fmt: skip
            faster = SDPA if row["median"] > 1 else FLEX
            row["status"] = "no data" if row["rounds"] == 0 else f"{faster} faster"
            rows.append(row)
    return pd.DataFrame(rows)


def bars_markdown(table: pd.DataFrame) -> str:
    fmt = lambda x: "-" if pd.isna(x) else f"{x:.2f}x"
    lines = ["| bar | T | threshold | median | range | rounds | status |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table.itertuples(index=False):
        lines.append(f"| {r.bar} | {r.T} | {r.threshold:.2f}x | {fmt(r.median)} "
                     f"| {fmt(r.low)} .. {fmt(r.high)} | {r.rounds} | {r.status} |")  # fmt: skip
    return "\n".join(lines)


def accuracy(x: dict) -> str:
    """The fused gated kernel and the eager reference at the inputs' dtype against float64, on
    the first sequence of the smallest shape: max abs errors."""
    q, k, v, gate = (x[n][:1].detach() for n in ("q", "k", "v", "gate"))
    lengths = x["lengths"][:1]
    kb, vg = gate_halves({"v": v, "gate": gate})
    ref = sigmoid_attention_reference(
        q.double(), k.double(), vg.double(), lengths, causal=True, key_bias_BT=kb.double()
    )
    fused = sigmoid_attention(q, k, vg, lengths, causal=True, key_bias_BT=kb)[0]
    in_kernel = sigmoid_attention(q, k, v, lengths, causal=True, gate_BT=gate)[0]
    eager = sigmoid_attention_reference(q, k, vg, lengths, causal=True, key_bias_BT=kb)
    err = lambda out: (out.double() - ref).abs().max().item()
    T = q.shape[2]
    return (
        f"accuracy T={T}, max abs vs float64: fused gated {err(fused):.2e}, fused gate in the "
        f"kernel {err(in_kernel):.2e}, eager {err(eager):.2e}"
    )


PROFILE_PROVIDERS = [OP, FUSED, GATE_OFF, "cudnn"]
PHASES = ("fwd", "bwd")


def in_op_range(fwd: Callable) -> Callable:
    """``fwd`` with its whole call inside the op's profiler range (the gate's ranges nest in it)."""

    def run(x):
        with marked(cp.OP_RANGE):
            return fwd(x)

    return run


def profile_provider(fwd, x: dict, calls: int, device: str) -> dict[str, tuple[dict, list]]:
    """Per phase (``PHASES``): the mean breakdown of a call (``causal_profile.mean_parts``, with
    the unprofiled ``wall_unprof`` / ``host_unprof`` medians) and its kernel table. The backward
    is the gradient of q, k, v and the gate, as in the timed bench; one call of each first
    (autotuning, allocations) outside the measurements."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fwd = in_op_range(fwd)
    out = fwd(x)
    leaves, g = [x["q"], x["k"], x["v"], x["gate"]], torch.randn_like(out)
    phase_calls = {
        "fwd": lambda: fwd(x),
        "bwd": lambda: torch.autograd.grad(out, leaves, g, retain_graph=True, allow_unused=True),
    }
    result = {}
    for phase, call in phase_calls.items():
        call()
        wall, host = cp.time_calls(call, calls, sync)
        events, windows = cp.profile_calls(call, calls, sync, device == "cuda")
        parts = {**cp.mean_parts(events, windows), "wall_unprof": wall, "host_unprof": host}
        result[phase] = (parts, cp.kernel_table(events, windows))
    return result


def profile_bench(args, device: str, dtype: torch.dtype) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``--profile``: per T and provider, each phase's breakdown (one row) and its kernels; a
    provider that cannot run a shape gives rows of NaN."""
    global _RANGES
    rows, kernels = [], []
    nan_parts = {**cp.mean_parts([], []), "wall_unprof": float("nan"), "host_unprof": float("nan")}
    _RANGES = True
    try:
        for T in args.seq_lens:
            x = make_inputs(args.tokens, args.hidden, T, device, dtype)
            for name in args.providers:
                try:
                    fwd = provider_fn(name, x)
                    phases = None if fwd is None else profile_provider(fwd, x, args.calls, device)
                except Exception as e:  # a row of NaN, as in the timed bench
                    _failed(name, T, e)
                    phases = None
                for phase in PHASES:
                    parts, table = phases[phase] if phases else (nan_parts, [])
                    key = {"T": T, "provider": name, "phase": phase}
                    rows.append({**key, **parts})
                    kernels += [{**key, **k} for k in table]
                    print(f"{name:18s} T={T:5d} {phase} wall {parts['wall']:8.1f} us, attention "
                          f"{parts[cp.ATTN]:8.1f} us (profiled)", flush=True)  # fmt: skip
            del x
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        _RANGES = False
    return pd.DataFrame(rows), pd.DataFrame(kernels)


def profile_report(head: str, calls: int, rows: pd.DataFrame, kernels: pd.DataFrame) -> str:
    """The breakdown tables (forward, backward) and the largest kernels besides attention."""
    recs, krecs = rows.to_dict("records"), kernels.to_dict("records")
    return (
        f"{head}; us per call: mean of {calls} profiled calls, each ended by a device sync "
        f"(`unprofiled`: medians of {calls} calls without the profiler; `host`: until the call "
        f"returned)\n\n### forward\n\n{cp.breakdown_markdown(recs, 'fwd')}\n\n"
        f"### backward\n\n{cp.breakdown_markdown(recs, 'bwd')}\n\n"
        f"### largest kernels besides attention\n\n{cp.kernels_markdown(krecs)}\n"
    )


def provenance(device: str) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})"
    versions = (
        f"torch {torch.__version__} | triton {triton.__version__} | CUDA {torch.version.cuda}"
    )
    return f"{datetime.date.today()} | {name} | {versions} | python {platform.python_version()}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/bench_causal", help="folder for the CSV and tables")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over them)")
    p.add_argument("--seq-lens", nargs="+", type=int, help="T values (default 512 1024 2048 8192)")
    p.add_argument("--hidden", type=int, help="model width; heads = hidden / 64 (default 768)")
    p.add_argument("--tokens", type=int, help="tokens per batch, B = tokens / T (default 16384)")
    p.add_argument("--providers", nargs="+",
                   help=f"default: all; with --profile {PROFILE_PROVIDERS}")  # fmt: skip
    smoke_help = "tiny shapes (T 32, 64 tokens, hidden 128), one timed call each"
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument("--profile", action="store_true",
                   help="per T and provider, where a call's time goes (torch.profiler), instead "
                   "of the TFLOPS table: causal_profile.{md,csv}, causal_profile_kernels.csv")  # fmt: skip
    p.add_argument("--calls", type=int, help="--profile: calls per phase (default 20, smoke 2)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    args.calls = args.calls if args.calls is not None else (2 if args.smoke else 20)
    if args.calls < 1:
        p.error(f"--calls must be >= 1, got {args.calls}")
    args.providers = args.providers or (PROFILE_PROVIDERS if args.profile else PROVIDERS)
    unknown = [n for n in args.providers if n not in PROVIDERS]
    if unknown:
        p.error(f"unknown providers {unknown}; choose from {PROVIDERS}")
    args.seq_lens = args.seq_lens or ([32] if args.smoke else list(SEQ_LENS))
    args.hidden = args.hidden or (128 if args.smoke else 768)
    args.tokens = args.tokens or (64 if args.smoke else 16_384)
    if args.hidden % HEAD_DIM:
        p.error(f"--hidden must be a multiple of the head dim {HEAD_DIM}, got {args.hidden}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit(
            "bench_causal needs a CUDA GPU; on CPU run it with --smoke and TRITON_INTERPRET=1"
        )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dot errs
    os.makedirs(args.out, exist_ok=True)
    head = f"{provenance(device)} | hd {HEAD_DIM}, hidden {args.hidden}, {args.tokens} tokens"
    print(head, flush=True)
    print(accuracy(make_inputs(args.tokens, args.hidden, min(args.seq_lens), device, dtype)))
    if args.profile:
        rows, kernels = profile_bench(args, device, dtype)
        rows.to_csv(os.path.join(args.out, "causal_profile.csv"), index=False)
        kernels.to_csv(os.path.join(args.out, "causal_profile_kernels.csv"), index=False)
        text = profile_report(head, args.calls, rows, kernels)
        with open(os.path.join(args.out, "causal_profile.md"), "w") as f:
            f.write(text)
        print("\n" + text)
        return
    df = bench(args, device, dtype)
    table, bar_table = summary(df), bars(df, every_t=args.smoke)
    bar_table.to_csv(os.path.join(args.out, "causal_bars.csv"), index=False)
    text = (f"{head}, {args.rounds} rounds; TFLOPS fwd / bwd over the causal half\n\n"
            f"{markdown_table(table)}\n\n{bars_markdown(bar_table)}\n")  # fmt: skip
    with open(os.path.join(args.out, "causal.md"), "w") as f:
        f.write(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
