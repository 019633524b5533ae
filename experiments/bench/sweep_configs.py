"""Launch-config sweep of the sigmoid attention kernels, each kernel timed alone (GPU only).

    python experiments/bench/sweep_configs.py --out runs/sweep_configs   # ~1.5 min on 2 H200s

For every kernel (forward, dQ, dK/dV), load path (``--tma 0 1``: pointer or TMA loads, the two
paths the op takes below and above T = 4096) and candidate launch config (BLOCK_M, BLOCK_N,
num_warps, num_stages) it compiles once (in parallel worker processes that share Triton's disk
cache), checks the result against the first variant of that kernel that ran (a miscompiled
variant is flagged, not timed as a win), and times it with ``do_bench`` (median ms) at bf16,
16,384 tokens per batch, hidden 2048, as ``bench_attention.py``. The kernels run with the op's
constexprs (fast sigmoid, q in registers where ``use_a_regs``). Head dim 64 runs on one GPU and
128 on another when two are visible. Prints, per head dim and T, the best config per (kernel, load
path) and the backward TFLOPS (2.5 x 4 H D sum L^2) the best pair would give, next to SDPA
cuDNN's in the same process; writes ``sweep.csv`` and ``sweep_summary.txt`` under ``--out``.
This is how the production lists in ``_configs`` (kernels/sigmoid_attention.py) are chosen.
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
from bench_attention import flops_fwd, make_inputs  # the script beside this one

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


def combos(head_dims, kinds, tmas, candidates=CANDIDATES):
    for D, kind in itertools.product(head_dims, kinds):
        for tma in tmas:
            for cfg in candidates[kind]:
                yield D, kind, tma, cfg


def parse_configs(specs: list[str]) -> dict:
    """``dq=128x64x8x3,64x64x4x3`` (BLOCK_M x BLOCK_N x warps x stages) replaces that kind's list."""
    out = dict(CANDIDATES)
    for spec in specs:
        kind, _, lst = spec.partition("=")
        if kind not in CANDIDATES or not lst:
            raise SystemExit(f"--configs: want KIND=BMxBNxWxS,... with KIND in {list(CANDIDATES)}")
        try:
            out[kind] = [tuple(int(x) for x in c.split("x")) for c in lst.split(",")]
        except ValueError:
            raise SystemExit(f"--configs {spec!r}: want BMxBNxWxS integers") from None
        if any(len(c) != 4 for c in out[kind]):
            raise SystemExit(f"--configs {spec!r}: want four numbers per config, BMxBNxWxS")
    return out


def inputs(T, D, pad, seed=0, device="cuda"):
    torch.manual_seed(seed)
    q, k, v, lengths = make_inputs(T, D, pad, device)
    q, k, v = (t.detach() for t in (q, k, v))
    return q, k, v, torch.randn_like(q), lengths


def runner(kind, D, tma, cfg, tensors):
    """A zero-argument launch of one kernel at one config, and its output tensors. In Triton's
    interpreter (``TRITON_INTERPRET=1``, a CPU check of this script) the exact sigmoid."""
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")  # the module

    q, k, v, do, lengths = tensors
    B, H, T, _ = q.shape
    bm, bn, warps, stages = cfg
    interp = sa.interpreting()
    if tma and not interp:
        triton.set_allocator(sa._device_allocator)
    common = dict(
        **sa._common_args(D, q.dtype, True, sa.TANH_F32), TMA=tma, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    scale = 1 / math.sqrt(D)
    if kind == "fwd":
        out = sa._empty_bthd_as_bhtd(q)
        n_mx = sa.cdiv(T, bm)
        mx = torch.zeros(B * H, n_mx, dtype=torch.float32, device=q.device)
        grid = (n_mx, B * H)
        args = sa._kernel_args((q, k, v, out), (mx,), lengths, H, T, n_mx, scale, 0.0)
        kern, outs = sa._sigmoid_fwd_kernel, (out,)
        common.update(RETURN_MAX=False, A_REGS=sa.use_a_regs(q, tma) and not interp)
    elif kind == "dq":
        dq = sa._empty_bthd_as_bhtd(q)
        grid = (sa.cdiv(T, bm), B * H)
        args = sa._kernel_args((q, k, v, do, dq), (), lengths, H, T, scale, 0.0)
        kern, outs = sa._sigmoid_bwd_dq_kernel, (dq,)
    else:
        dk, dv = sa._empty_bthd_as_bhtd(k), sa._empty_bthd_as_bhtd(v)
        grid = (sa.cdiv(T, bn), B * H)
        args = sa._kernel_args((q, k, v, do, dk, dv), (), lengths, H, T, scale, 0.0)
        kern, outs = sa._sigmoid_bwd_dkdv_kernel, (dk, dv)
    if interp:
        kern = sa.interpreted(kern)
    return (lambda: kern[grid](*args, **common)), outs


def warm(jobs, gpu):
    """Worker: compile each job once (Triton's disk cache keeps it for the timing pass)."""
    torch.cuda.set_device(gpu)
    tensors = {D: inputs(4096, D, 0.0) for D in {j[0] for j in jobs}}
    for D, kind, tma, cfg in jobs:
        try:
            runner(kind, D, tma, cfg, tensors[D])[0]()
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory and the like: reported by the timing pass
            print(f"warm fail {D} {kind} tma={tma} {cfg}: {type(e).__name__}", flush=True)


def cudnn_tflops(q, k, v, do) -> tuple[float, float]:
    """SDPA cuDNN softmax at full length (the bar's baseline): forward and backward TFLOPS."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

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


def checked_variants(D, T, pad, tensors, kinds, tmas, candidates) -> tuple[list, list]:
    """One row per variant, and ``(row, launch)`` for those that ran and agree (relative max
    deviation < 2e-2) with the first variant of their kernel."""
    rows, ok, ref = [], [], {}
    for _, kind, tma, cfg in combos([D], kinds, tmas, candidates):
        row = dict(D=D, T=T, pad=pad, kernel=kind, tma=int(tma), config="x".join(map(str, cfg)),
                   ms=float("nan"), err="")  # fmt: skip
        try:
            fn, outs = runner(kind, D, tma, cfg, tensors)
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
                ok.append((row, fn))
        except Exception as e:
            row["err"] = type(e).__name__
        rows.append(row)
    return rows, ok


def time_all(D, seq_lens, pads, gpu, out_csv, kinds, tmas, candidates, repeat):
    torch.cuda.set_device(gpu)
    rows = []
    for T, pad in itertools.product(seq_lens, pads):
        tensors = inputs(T, D, pad)
        q, k, v, do, lengths = tensors
        flops = flops_fwd(q.shape[1], D, lengths.tolist())
        shape_rows, fns = checked_variants(D, T, pad, tensors, kinds, tmas, candidates)
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
        shape_rows.append(dict(D=D, T=T, pad=pad, kernel="cudnn", config="", err="",
                               cudnn_fwd_tflops=fwd_tf, cudnn_bwd_tflops=bwd_tf))  # fmt: skip
        for r in shape_rows:
            r["fwd_flops"] = flops
            r["flops"] = EXECUTED.get(r["kernel"], 0.0) * flops
        rows += shape_rows
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
        for (kind, tma), h in g[g.kernel != "cudnn"].groupby(["kernel", "tma"]):
            ok = h.dropna(subset=["ms"])
            bad = ", ".join(f"{c}:{e}" for c, e in zip(h.config, h.err, strict=True) if e)
            if ok.empty:
                lines.append(f"  {kind:5s} tma={int(tma)}  none ran ({bad})")
                continue
            b = ok.loc[ok.ms.idxmin()]
            best[(kind, int(tma))] = b.ms
            tf = b.flops / b.ms * 1e-9
            lines.append(f"  {kind:5s} tma={int(tma)}  best {b.config:12s} {b.ms:.3f} ms "
                         f"({tf:.0f} TFLOPS executed){'  fails: ' + bad if bad else ''}")  # fmt: skip
        for (kind, tma), ms_dq in best.items():
            if kind == "dq" and ("dkdv", tma) in best:
                ms = ms_dq + best[("dkdv", tma)]
                lines.append(f"  bwd tma={tma}: {flops / ms * 1e-9:.0f} TFLOPS")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--paddings", type=float, nargs="+", default=[0.0])
    p.add_argument("--kinds", nargs="+", default=["fwd", "dq", "dkdv"], choices=list(CANDIDATES))
    p.add_argument("--tma", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                   help="load paths: 0 pointer loads, 1 TMA tensor descriptors")  # fmt: skip
    p.add_argument("--configs", nargs="*", default=[], help="KIND=BMxBNxWxS,... per kind")
    p.add_argument("--repeat", type=int, default=1, help="interleaved timing rounds (median)")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    candidates = parse_configs(a.configs)
    if not torch.cuda.is_available():
        sys.exit("sweep_configs: needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    n_gpu = torch.cuda.device_count()
    tmas = [bool(t) for t in a.tma]
    jobs = list(combos(a.head_dims, a.kinds, tmas, candidates))
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
                               a.kinds, tmas, candidates, a.repeat))
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
