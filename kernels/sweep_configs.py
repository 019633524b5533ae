"""Config and lever sweep of the sigmoid attention kernels, each kernel timed alone (GPU only).

    PYTHONPATH=. python3 kernels/sweep_configs.py --out results/bench/sweep   # ~1.5 min on 2 H200s

For every kernel (forward, dQ, dK/dV), lever set (TMA, LOOKAHEAD, A_REGS; the forward's Q_TILES too) and candidate launch
config (BLOCK_M, BLOCK_N, num_warps, num_stages) it compiles once (in parallel worker processes
that share Triton's disk cache), checks the result against the first variant of that kernel that ran
(the plain kernel at the first config for dQ and dK/dV; TMA + lookahead for the forward; a
miscompiled variant is flagged, not timed as a win), and times it with ``do_bench`` (median ms) at
bf16, 16,384 tokens per batch, hidden 2048, as ``kernels/bench_attention.py``. Head dim 64 runs on
one GPU and 128 on another when two are visible, one after the other on a single GPU. Prints,
per head dim and T, the best config per (kernel, levers) and the backward TFLOPS
(2.5 x 4 H D sum L^2) the best pair would give, next to SDPA cuDNN's in the same process. This is
how the production lists in ``_configs`` are chosen.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import multiprocessing as mp
import os
import sys

import pandas as pd
import torch
import triton

CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    "fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
            (128, 128, 8, 4), (128, 64, 8, 4), (64, 128, 4, 3)],
    "dq": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2),
           (128, 32, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3)],
    "dkdv": [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3),
             (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3)],
}  # fmt: skip
# Matrix products a kernel executes per score, in units of the forward's two: q k^T and P V.
EXECUTED = {"fwd": 1.0, "dq": 1.5, "dkdv": 2.0}
# The kernels' lever constexprs, in digit order: three switches, then the forward's query tiles
# per program (a count; the backward kernels take one tile per program).
LEVER_NAMES = ("tma", "lookahead", "a_regs", "q_tiles")
LEVERS = [(False, False, False, 1), (False, True, False, 1), (True, False, False, 1),
          (True, True, False, 1)]  # fmt: skip
# The forward's TMA and lookahead were swept before (docs/BENCHMARKS.md): both on; A_REGS off/on,
# and with it four query tiles per program (the op's choice at head dim 128, session 8).
FWD_LEVERS = [(True, True, False, 1), (True, True, True, 1), (True, True, True, 4)]


def parse_levers(specs: list[str], kind: str = "fwd") -> list[tuple]:
    """``"10"`` = TMA without lookahead; ``"1114"`` = TMA, lookahead, A_REGS, four query tiles per
    program. Up to four digits in ``LEVER_NAMES`` order: the switches 0/1 (missing = 0), the tile
    count 1-9 (missing = 1, and only 1 for the backward kernels)."""
    out = []
    n = len(LEVER_NAMES)
    for x in specs:
        if not (1 <= len(x) <= n) or set(x[: n - 1]) - {"0", "1"} or not x.isdigit():
            raise SystemExit(f"lever set {x!r}: want up to {n - 1} digits 0/1, then a tile count")
        tiles = int(x[n - 1]) if len(x) == n else 1
        if not 1 <= tiles <= 9 or (kind != "fwd" and tiles != 1):
            raise SystemExit(
                f"lever set {x!r}: query tiles per program 1-9 (forward), 1 (backward)"
            )
        out.append((*(c == "1" for c in x[: n - 1].ljust(n - 1, "0")), tiles))
    return out


def lever_digits(lev: tuple) -> str:
    """The command-line spelling of a lever set, ``parse_levers``' inverse."""
    *switches, tiles = lev
    return "".join("1" if x else "0" for x in switches) + str(tiles)


def combos(
    head_dims, kinds, levers=LEVERS, candidates=CANDIDATES, fwd_levers=FWD_LEVERS
):  # fmt: skip
    for D, kind in itertools.product(head_dims, kinds):
        for lev in fwd_levers if kind == "fwd" else levers:
            for cfg in candidates[kind]:
                yield D, kind, lev, cfg


def parse_configs(specs: list[str]) -> dict:
    """``dq=128x64x8x3,64x64x4x3`` (BLOCK_M x BLOCK_N x warps x stages) replaces that kind's list."""
    out = dict(CANDIDATES)
    for spec in specs:
        kind, _, lst = spec.partition("=")
        if kind not in CANDIDATES or not lst:
            raise SystemExit(f"--configs: want KIND=BMxBNxWxS,... with KIND in {list(CANDIDATES)}")
        out[kind] = [tuple(int(x) for x in c.split("x")) for c in lst.split(",")]
    return out


def inputs(T, D, pad, seed=0):
    from stabilitylab.kernels.bench_attention import make_inputs

    torch.manual_seed(seed)
    q, k, v, lengths = make_inputs(T, D, pad)
    q, k, v = (t.detach() for t in (q, k, v))
    return q, k, v, torch.randn_like(q), lengths


def runner(kind, D, lev, cfg, tensors):
    """A zero-argument launch of one kernel at one config, and its output tensors."""
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")  # the module

    q, k, v, do, lengths = tensors
    B, H, T, _ = q.shape
    bm, bn, warps, stages = cfg
    tma, la, a_regs, q_tiles = lev
    interp = os.environ.get("TRITON_INTERPRET") == "1"  # a CPU smoke test of this script
    if tma and not interp:
        triton.set_allocator(sa._device_allocator)
    common = dict(
        HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.EXACT if interp else sa.TANH_F32,
        DOT_PRECISION="tf32", TMA=tma, LOOKAHEAD=la, A_REGS=a_regs and not interp, BLOCK_M=bm,
        BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    scale = 1 / math.sqrt(D)
    if kind == "fwd":
        out = sa._empty_bthd_as_bhtd(q)
        n_mx = triton.cdiv(T, bm)
        mx = torch.zeros(B * H, n_mx, dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(triton.cdiv(T, bm), q_tiles), B * H)
        args = sa._kernel_args((q, k, v, out), (mx,), lengths, H, T, n_mx, scale, 0.0)
        kern, outs = sa._sigmoid_fwd_kernel, (out,)
        common.update(RETURN_MAX=False, Q_TILES=q_tiles)
    elif kind == "dq":
        dq = sa._empty_bthd_as_bhtd(q)
        grid = (triton.cdiv(T, bm), B * H)
        args = sa._kernel_args((q, k, v, do, dq), (), lengths, H, T, scale, 0.0)
        kern, outs = sa._sigmoid_bwd_dq_kernel, (dq,)
    else:
        dk, dv = sa._empty_bthd_as_bhtd(k), sa._empty_bthd_as_bhtd(v)
        grid = (triton.cdiv(T, bn), B * H)
        args = sa._kernel_args((q, k, v, do, dk, dv), (), lengths, H, T, scale, 0.0)
        kern, outs = sa._sigmoid_bwd_dkdv_kernel, (dk, dv)
    return (lambda: kern[grid](*args, **common)), outs


def warm(jobs, gpu):
    """Worker: compile each job once (Triton's disk cache keeps it for the timing pass)."""
    torch.cuda.set_device(gpu)
    tensors = {D: inputs(4096, D, 0.0) for D in {j[0] for j in jobs}}
    for D, kind, lev, cfg in jobs:
        try:
            runner(kind, D, lev, cfg, tensors[D])[0]()
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory and the like: reported by the timing pass
            print(f"warm fail {D} {kind} {lev} {cfg}: {type(e).__name__}", flush=True)


def cudnn_tflops(q, k, v, do) -> tuple[float, float]:
    """SDPA cuDNN softmax at full length (the bar's baseline): forward and backward TFLOPS."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stabilitylab.kernels.bench_attention import flops_fwd

    B, H, T, D = q.shape
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qg, kg, vg)
        fwd_ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qg, kg, vg))
        bwd_ms = triton.testing.do_bench(
            lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
        )
    full = flops_fwd(H, D, [T] * B)
    return full / fwd_ms * 1e-9, 2.5 * full / bwd_ms * 1e-9


def time_all(D, seq_lens, pads, gpu, out_csv, kinds, levers, candidates, repeat, fwd_levers):
    from stabilitylab.kernels.bench_attention import flops_fwd

    torch.cuda.set_device(gpu)
    rows = []
    for T, pad in itertools.product(seq_lens, pads):
        tensors = inputs(T, D, pad)
        q, k, v, do, lengths = tensors
        flops = flops_fwd(q.shape[1], D, lengths.tolist())
        ref = {}
        fns = []
        for kind in kinds:
            for _, _, lev, cfg in combos([D], [kind], levers, candidates, fwd_levers):
                row = dict(D=D, T=T, pad=pad, kernel=kind, config="x".join(map(str, cfg)),
                           ms=float("nan"), err="", **dict(zip(LEVER_NAMES, lev, strict=True)))  # fmt: skip
                try:
                    fn, outs = runner(kind, D, lev, cfg, tensors)
                    fn()
                    torch.cuda.synchronize()
                    if kind not in ref:
                        ref[kind] = [o.float().clone() for o in outs]
                    dev = max(
                        ((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item()
                        for o, r in zip(outs, ref[kind], strict=True)
                    )
                    row["rel_dev"] = dev
                    if not dev < 2e-2:
                        row["err"] = "mismatch"
                    else:
                        fns.append((row, fn))
                except Exception as e:
                    row["err"] = type(e).__name__
                rows.append(row)
        # Interleaved repeats: each round times every variant once; the median over rounds is kept.
        times = {id(row): [] for row, _ in fns}
        for _ in range(repeat):
            for row, fn in fns:
                times[id(row)].append(triton.testing.do_bench(fn, warmup=10, rep=60))
        for row, _ in fns:
            ts = sorted(times[id(row)])
            row["ms"] = ts[len(ts) // 2]
            row["ms_spread"] = (ts[-1] - ts[0]) / ts[len(ts) // 2]
        fwd_tf, bwd_tf = cudnn_tflops(q, k, v, do)
        rows.append(dict(D=D, T=T, pad=pad, kernel="cudnn", config="", err="",
                         cudnn_fwd_tflops=fwd_tf, cudnn_bwd_tflops=bwd_tf))  # fmt: skip
        for r in rows:
            if r["T"] == T and r["pad"] == pad:
                r["fwd_flops"] = flops
                r["flops"] = EXECUTED.get(r["kernel"], 0.0) * flops
        print(f"D={D} T={T} pad={pad} timed", flush=True)
    pd.DataFrame(rows).to_csv(out_csv, index=False)


def summarise(df: pd.DataFrame) -> str:
    lines = []
    df = df.assign(err=df["err"].fillna(""))
    for (D, T, pad), g in df.groupby(["D", "T", "pad"]):
        cud = g[g.kernel == "cudnn"].iloc[0]
        flops = 2.5 * g.fwd_flops.iloc[0]  # the backward's, by the 2.5x convention
        lines.append(f"\nD={D} T={T} pad={pad}: cuDNN fwd {cud.cudnn_fwd_tflops:.0f} "
                     f"bwd {cud.cudnn_bwd_tflops:.0f} TFLOPS")  # fmt: skip
        best = {}
        names = [n for n in LEVER_NAMES if n in g.columns]
        for (kind, *lev), h in g[g.kernel != "cudnn"].groupby(["kernel", *names]):
            lev = tuple(int(x) for x in lev)
            tag = " ".join(f"{n}={x:d}" for n, x in zip(names, lev, strict=True))
            ok = h.dropna(subset=["ms"])
            bad = ", ".join(f"{c}:{e}" for c, e in zip(h.config, h.err, strict=True) if e)
            if ok.empty:
                lines.append(f"  {kind:5s} {tag}  none ran ({bad})")
                continue
            b = ok.loc[ok.ms.idxmin()]
            best[(kind, lev)] = (b.ms, tag)
            tf = b.flops / b.ms * 1e-9
            lines.append(f"  {kind:5s} {tag}  best {b.config:12s} {b.ms:.3f} ms "
                         f"({tf:.0f} TFLOPS executed){'  fails: ' + bad if bad else ''}")  # fmt: skip
        for (kind, lev), (ms_dq, tag) in best.items():
            if kind == "dq" and ("dkdv", lev) in best:
                ms = ms_dq + best[("dkdv", lev)][0]
                lines.append(f"  bwd {tag}: {flops / ms * 1e-9:.0f} TFLOPS")
        for kd in ("dq", "dkdv"):
            if not any(k[0] == kd for k in best):
                continue
            ms, tag = min(v for k, v in best.items() if k[0] == kd)
            lines.append(f"  best {kd}: {tag} {ms:.3f} ms")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--paddings", type=float, nargs="+", default=[0.0])
    p.add_argument("--kinds", nargs="+", default=["fwd", "dq", "dkdv"])
    p.add_argument(
        "--levers",
        nargs="+",
        default=[lever_digits(lev) for lev in LEVERS],
        help="TMA, LOOKAHEAD, A_REGS as up to three digits (missing = 0), e.g. 10 = TMA without"
        " lookahead, 111 = TMA + lookahead + the A operand in registers; a fourth digit is the"
        " forward's query tiles per program (1 here)",
    )
    p.add_argument(
        "--fwd-levers", nargs="+", default=[lever_digits(lev) for lev in FWD_LEVERS],
        help="the same, forward; e.g. 1114 = TMA, lookahead, A_REGS, 4 query tiles per program",
    )  # fmt: skip
    p.add_argument("--configs", nargs="*", default=[], help="KIND=BMxBNxWxS,... per kind")
    p.add_argument("--repeat", type=int, default=1, help="interleaved timing rounds (median)")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sweep_configs: needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    n_gpu = torch.cuda.device_count()
    levers, fwd_levers = parse_levers(a.levers, "bwd"), parse_levers(a.fwd_levers)
    candidates = parse_configs(a.configs)
    jobs = list(combos(a.head_dims, a.kinds, levers, candidates, fwd_levers))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=warm, args=(jobs[i :: a.workers], i % n_gpu))
             for i in range(a.workers)]  # fmt: skip
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    print(f"compiled {len(jobs)} variants", flush=True)
    procs = [ctx.Process(target=time_all,
                         args=(D, a.seq_lens, a.paddings, i % n_gpu, f"{a.out}/sweep_d{D}.csv",
                               a.kinds, levers, candidates, a.repeat, fwd_levers))
             for i, D in enumerate(a.head_dims)]  # fmt: skip
    # One timing process per GPU at a time: two on one GPU would halve each other's figures.
    for wave in range(0, len(procs), n_gpu):
        for pr in procs[wave : wave + n_gpu]:
            pr.start()
        for pr in procs[wave : wave + n_gpu]:
            pr.join()
    df = pd.concat(pd.read_csv(f"{a.out}/sweep_d{D}.csv") for D in a.head_dims)
    df.to_csv(f"{a.out}/sweep.csv", index=False)
    text = summarise(df)
    print(text)
    with open(f"{a.out}/sweep_summary.txt", "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
