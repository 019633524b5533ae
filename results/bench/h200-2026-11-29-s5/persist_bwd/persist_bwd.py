"""Experiment (session 5): persistent dQ and dK/dV kernels (plain outer loop vs flattened) against the
production kernels at their configs, unpadded. Scratch, GPU only."""
import importlib, itertools, math, multiprocessing as mp, os, sys
import torch, triton, triton.language as tl
import pandas as pd


@triton.jit
def _dq_persist(Q, K, V, DO, DQ, LENS, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
                sdqb, sdqh, sdqt, H, T, n_m, n_tiles, scale,
                HEAD_DIM: tl.constexpr, FLATTEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    a_s = 0.5 * scale
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_bh = tile // n_m
        pid_m = tile - pid_bh * n_m
        b = pid_bh // H
        h = pid_bh - b * H
        L = tl.load(LENS + b).to(tl.int32)
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        b64 = b.to(tl.int64)
        q_base = Q + b64 * sqb + h * sqh
        do_base = DO + b64 * sdob + h * sdoh
        k_base = K + b64 * skb + h * skh
        v_base = V + b64 * svb + h * svh
        c_s = -0.5 * tl.log(L.to(tl.float32))
        n_end = tl.where(start_m < L, L, 0)
        row_mask = offs_m[:, None] < L
        q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :], mask=row_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdot + offs_d[None, :], mask=row_mask, other=0.0)
        dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        for start_n in range(0, n_end, BLOCK_N):
            rows_n = start_n + offs_n
            k = tl.load(k_base + rows_n[:, None] * skt + offs_d[None, :], mask=rows_n[:, None] < L, other=0.0)
            v = tl.load(v_base + rows_n[:, None] * svt + offs_d[None, :], mask=rows_n[:, None] < L, other=0.0)
            dp = tl.dot(do, tl.trans(v))
            s = tl.dot(q, tl.trans(k))
            x = s * a_s + c_s
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
            ds = (1.0 - t * t) * dp
            dq = tl.dot(ds.to(k.dtype), k, dq)
        tl.store(DQ + b64 * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
                 (dq * (0.25 * scale)).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


@triton.jit
def _dkdv_persist(Q, K, V, DO, DK, DV, LENS, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
                  sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, T, n_n, n_tiles, scale,
                  HEAD_DIM: tl.constexpr, TMA: tl.constexpr, FLATTEN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = tl.arange(0, BLOCK_M)
    a_s = 0.5 * scale
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_bh = tile // n_n
        pid_n = tile - pid_bh * n_n
        b = pid_bh // H
        h = pid_bh - b * H
        L = tl.load(LENS + b).to(tl.int32)
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        b64 = b.to(tl.int64)
        q_base = Q + b64 * sqb + h * sqh
        do_base = DO + b64 * sdob + h * sdoh
        k_base = K + b64 * skb + h * skh
        v_base = V + b64 * svb + h * svh
        c_s = -0.5 * tl.log(L.to(tl.float32))
        m_end = tl.where(start_n < L, L, 0)
        if TMA:
            q_desc = tl.make_tensor_descriptor(q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM])
            do_desc = tl.make_tensor_descriptor(do_base, shape=[L, HEAD_DIM], strides=[sdot, 1], block_shape=[BLOCK_M, HEAD_DIM])
        key_mask = offs_n[:, None] < L
        k = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :], mask=key_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svt + offs_d[None, :], mask=key_mask, other=0.0)
        dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
        for start_m in range(0, m_end, BLOCK_M):
            if TMA:
                q = q_desc.load([start_m, 0])
                do = do_desc.load([start_m, 0])
            else:
                rows_m = start_m + offs_m
                q = tl.load(q_base + rows_m[:, None] * sqt + offs_d[None, :], mask=rows_m[:, None] < L, other=0.0)
                do = tl.load(do_base + rows_m[:, None] * sdot + offs_d[None, :], mask=rows_m[:, None] < L, other=0.0)
            dp_t = tl.dot(v, tl.trans(do))
            s_t = tl.dot(k, tl.trans(q))
            x_t = s_t * a_s + c_s
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x_t], dtype=tl.float32, is_pure=True, pack=1)
            p_t = 0.5 * t + 0.5
            ds_t = (1.0 - t * t) * dp_t
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dk = tl.dot(ds_t.to(q.dtype), q, dk)
        valid = offs_n[:, None] < L
        in_range = offs_n[:, None] < T
        tl.store(DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
                 tl.where(valid, dk * (0.25 * scale), 0.0).to(DK.dtype.element_ty), mask=in_range)
        tl.store(DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
                 tl.where(valid, dv, 0.0).to(DV.dtype.element_ty), mask=in_range)


PROD = {"dq": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
        "dkdv": [(64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)]}
N_SM = 132


def sa():
    return importlib.import_module("stabilitylab.kernels.sigmoid_attention")


def inputs(T, D, pad, seed=0):
    from stabilitylab.kernels.bench_attention import make_inputs
    torch.manual_seed(seed)
    q, k, v, lengths = make_inputs(T, D, pad)
    q, k, v = (t.detach() for t in (q, k, v))
    return q, k, v, torch.randn_like(q), lengths


def prun(kind, D, fl, tma, cfg, mult, tensors):
    m = sa()
    q, k, v, do, lengths = tensors
    B, H, T, _ = q.shape
    bm, bn, w, s = cfg
    if tma:
        triton.set_allocator(m._device_allocator)
    st = lambda ts: [x for t in ts for x in (t.stride(0), t.stride(1), t.stride(2))]
    kw = dict(HEAD_DIM=D, FLATTEN=bool(fl), BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    if kind == "dq":
        dq = m._empty_bthd_as_bhtd(q)
        n = triton.cdiv(T, bm); nt = n * B * H
        args = (q, k, v, do, dq, lengths, *st((q, k, v, do, dq)), H, T, n, nt, 1 / math.sqrt(D))
        grid = (min(nt, mult * N_SM),)
        return (lambda: _dq_persist[grid](*args, **kw)), (dq,)
    dk, dv = m._empty_bthd_as_bhtd(k), m._empty_bthd_as_bhtd(v)
    n = triton.cdiv(T, bn); nt = n * B * H
    args = (q, k, v, do, dk, dv, lengths, *st((q, k, v, do, dk, dv)), H, T, n, nt, 1 / math.sqrt(D))
    grid = (min(nt, mult * N_SM),)
    return (lambda: _dkdv_persist[grid](*args, TMA=bool(tma), **kw)), (dk, dv)


def jobs():
    for D, kind in itertools.product((64, 128), ("dq", "dkdv")):
        for cfg in PROD[kind]:
            yield ("prod", D, kind, 0, 1 if kind == "dkdv" else 0, cfg)
            for fl in (0, 1):
                yield ("persist", D, kind, fl, 1 if kind == "dkdv" else 0, cfg)


def make(job, mult, tensors):
    src, D, kind, fl, tma, cfg = job
    if src == "prod":
        from kernels.sweep_configs import runner  # noqa
        return runner(kind, D, (bool(tma), False), cfg, tensors)
    return prun(kind, D, fl, tma, cfg, mult, tensors)


def warm(js, gpu):
    torch.cuda.set_device(gpu)
    tens = {D: inputs(4096, D, 0.0) for D in (64, 128)}
    for j in js:
        try:
            make(j, 1, tens[j[1]])[0](); torch.cuda.synchronize()
        except Exception as e:
            print("warm fail", j, type(e).__name__, str(e)[:150], flush=True)


def time_all(D, gpu, out_csv, seq_lens, repeat):
    torch.cuda.set_device(gpu)
    rows = []
    for T in seq_lens:
        tens = inputs(T, D, 0.0)
        fns, ref = [], {}
        for j in jobs():
            if j[1] != D:
                continue
            for mult in ((1,) if j[0] == "prod" else (1, 2)):
                name = f"{j[0]} {j[2]} fl={j[3]} tma={j[4]}"
                c = "x".join(map(str, j[5])) + f" g{mult}"
                try:
                    fn, outs = make(j, mult, tens)
                    fn(); torch.cuda.synchronize()
                    if j[2] not in ref:
                        ref[j[2]] = [o.float().clone() for o in outs]
                    dev = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, ref[j[2]]))
                    if dev < 2e-2:
                        fns.append((j[2], name, c, fn))
                    else:
                        rows.append(dict(D=D, T=T, kind=j[2], name=name, cfg=c, err=f"mismatch {dev:.3g}"))
                except Exception as e:
                    rows.append(dict(D=D, T=T, kind=j[2], name=name, cfg=c, err=type(e).__name__))
        times = {i: [] for i in range(len(fns))}
        for _ in range(repeat):
            for i, f in enumerate(fns):
                times[i].append(triton.testing.do_bench(f[3], warmup=10, rep=50))
        for i, (kind, name, c, _) in enumerate(fns):
            ts = sorted(times[i]); ms = ts[len(ts) // 2]
            rows.append(dict(D=D, T=T, kind=kind, name=name, cfg=c, ms=ms, spread=(ts[-1] - ts[0]) / ms, err=""))
        print(f"D={D} T={T} done", flush=True)
    pd.DataFrame(rows).to_csv(out_csv, index=False)


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    js = list(jobs())
    ctx = mp.get_context("spawn")
    nw = 14
    ng = torch.cuda.device_count()
    ps = [ctx.Process(target=warm, args=(js[i::nw], i % ng)) for i in range(nw)]
    [p.start() for p in ps]; [p.join() for p in ps]
    print("compiled", len(js), flush=True)
    ps = [ctx.Process(target=time_all, args=(D, i % ng, f"{out}/pbwd_d{D}.csv", [4096, 8192, 16384], 3))
          for i, D in enumerate((64, 128))]
    [p.start() for p in ps]; [p.join() for p in ps]
    df = pd.concat(pd.read_csv(f"{out}/pbwd_d{D}.csv") for D in (64, 128))
    df.to_csv(f"{out}/pbwd.csv", index=False)
    pd.set_option("display.width", 200); pd.set_option("display.max_rows", 500)
    ok = df[df.err.fillna("") == ""]
    best = ok.loc[ok.groupby(["D", "T", "name"]).ms.idxmin()]
    print(best[["D", "T", "name", "cfg", "ms", "spread"]].to_string(index=False))
    bad = df[df.err.fillna("") != ""]
    if len(bad):
        print(bad[["D", "T", "name", "cfg", "err"]].drop_duplicates(["D", "name", "cfg", "err"]).to_string(index=False))
