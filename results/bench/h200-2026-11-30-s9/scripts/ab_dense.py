"""Session 9: kernels for unpadded batches with host-built rank-4 descriptors (dense_k.py) vs the
op's kernels (direct: forward_auto / backward_auto) vs SDPA cuDNN; one process, interleaved rounds.
    python3 ab_dense.py OUTDIR ROUNDS"""
import importlib, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.dirname(__file__))
import dense_k as dk
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
out_dir, rounds = sys.argv[1], int(sys.argv[2])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
KEY = ["T_BUCKET", "HEAD_DIM", "A_REGS", "SIGMOID", "RETURN_MAX"]
FWD = triton.autotune(dk.cfgs([(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3)], dk._hook_fwd), key=KEY)(dk._fwd_dense)
DQ = triton.autotune(dk.cfgs([(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)], dk._hook_bwd), key=KEY[:4])(dk._dq_dense)
WS = triton.autotune(dk.cfgs([(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2)], dk._hook_fwd), key=KEY)(dk._fwd_dense_ws)
DKDV = triton.autotune(dk.cfgs([(64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)], dk._hook_bwd), key=KEY[:4])(dk._dkdv_dense)


def dense_fwd(q, k, v, L, a_regs, ret_max=False, kern=None):
    B, H, T, D = q.shape
    out = sa._empty_bthd_as_bhtd(q)
    n_mx = triton.cdiv(T, 128)
    mx = torch.zeros(B * H, n_mx, device=q.device) if ret_max else torch.zeros(1, device=q.device)
    grid = lambda m: (triton.cdiv(T, m["BLOCK_M"]), B * H)
    (kern or FWD)[grid](dk.desc(q, 128), dk.desc(k, 64), dk.desc(v, 64), out, mx, L, *out.stride()[:3], H, T,
              sa.seq_bucket(T), n_mx, 1 / math.sqrt(D), 0.0, HEAD_DIM=D, LOG_BIAS=True, SIGMOID=1,
              RETURN_MAX=ret_max, DOT_PRECISION="tf32", A_REGS=a_regs)
    return out, (mx.amax(1).view(B, H) if ret_max else None)


def dense_bwd(do, q, k, v, L):
    B, H, T, D = q.shape
    dq = sa._empty_bthd_as_bhtd(q)
    qd, kd, vd, dod = dk.desc(q, 128), dk.desc(k, 64), dk.desc(v, 64), dk.desc(do, 128)
    DQ[lambda m: (triton.cdiv(T, m["BLOCK_M"]), B * H)](
        qd, kd, vd, dod, dq, L, *dq.stride()[:3], H, T, sa.seq_bucket(T), 1 / math.sqrt(D), 0.0,
        HEAD_DIM=D, LOG_BIAS=True, SIGMOID=1, DOT_PRECISION="tf32", A_REGS=False)
    dkk, dvv = sa._empty_bthd_as_bhtd(k), sa._empty_bthd_as_bhtd(v)
    qd, kd, vd, dod = dk.desc(q, 128), dk.desc(k, 64), dk.desc(v, 64), dk.desc(do, 128)
    DKDV[lambda m: (triton.cdiv(T, m["BLOCK_N"]), B * H)](
        qd, kd, vd, dod, dkk, dvv, L, *dkk.stride()[:3], *dvv.stride()[:3], H, T, sa.seq_bucket(T),
        1 / math.sqrt(D), 0.0, HEAD_DIM=D, LOG_BIAS=True, SIGMOID=1, DOT_PRECISION="tf32", A_REGS=False)
    return dq, dkk, dvv


TS = [int(x) for x in os.environ.get("TS", "4096,8192,16384").split(",")]
WS_T = [int(x) for x in os.environ.get("WS_T", "").split(",") if x]
rows = []
def emit(s):
    print(s, flush=True); rows.append(s)

for D in (128, 64):
    for T in TS:
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, 0.0)
        fl = flops_fwd(q.shape[1], D, L.tolist())
        qd, kd, vd = (t.detach() for t in (q, k, v))
        scale = 1 / math.sqrt(D)
        do = torch.randn_like(qd)
        # correctness vs the op's kernels
        o_ref, m_ref = sa.sigmoid_attention(qd, kd, vd, L, return_max_logit=True)
        for ar in ((True, False) if D == 128 else (False,)):
            o, m = dense_fwd(qd, kd, vd, L, ar, True)
            emit(f"D={D} T={T} check fwd a_regs={ar}: equal {torch.equal(o, o_ref)} maxdiff {(o.float()-o_ref.float()).abs().max().item():.3g} max equal {torch.equal(m, m_ref)} {(m-m_ref).abs().max().item():.3g}")
        g_ref = sa.backward_auto(do, qd, kd, vd, L, scale, 0.0, True, 1)
        g = dense_bwd(do, qd, kd, vd, L)
        for n, a, b_ in zip(("dq", "dk", "dv"), g, g_ref):
            emit(f"D={D} T={T} check {n}: equal {torch.equal(a, b_)} maxdiff {(a.float()-b_.float()).abs().max().item():.3g} scale {b_.float().abs().max().item():.3g}")
        fns = {"fwd op": lambda: sa.forward_auto(qd, kd, vd, L, scale, 0.0, True, 1, False)}
        if D == 128:
            fns["fwd dense ar"] = lambda: dense_fwd(qd, kd, vd, L, True)
        fns["fwd dense"] = lambda: dense_fwd(qd, kd, vd, L, False)
        if T in WS_T:
            try:
                o = dense_fwd(qd, kd, vd, L, False, kern=WS)[0]
                emit(f"D={D} T={T} check ws: maxdiff {(o.float()-o_ref.float()).abs().max().item():.3g} ref max {o_ref.float().abs().max().item():.3g}")
                fns["fwd dense ws"] = lambda: dense_fwd(qd, kd, vd, L, False, kern=WS)
            except Exception as e:
                emit(f"D={D} T={T} ws failed: {type(e).__name__}: {str(e)[:400]}")
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd)
        fns["fwd cudnn"] = cud
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(q, k, v)
        fns["bwd op"] = lambda: sa.backward_auto(do, qd, kd, vd, L, scale, 0.0, True, 1)
        fns["bwd dense"] = lambda: dense_bwd(do, qd, kd, vd, L)
        fns["bwd cudnn"] = lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)
        res = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
        for n in fns:
            ms = sorted(res[n])[len(res[n]) // 2]
            c = 2.5 if n.startswith("bwd") else 1.0
            emit(f"D={D:3d} T={T:5d} {n:13s} {ms:8.4f} ms {c*fl/ms*1e-9:6.1f} TFLOPS [{c*fl/max(res[n])*1e-9:5.0f}, {c*fl/min(res[n])*1e-9:5.0f}]")
        for kind in ("fwd", "bwd"):
            base = sorted(res[f"{kind} cudnn"])
            for n in fns:
                if n.startswith(kind) and "cudnn" not in n:
                    r = sorted(a / b - 1 for a, b in zip(res[f"{kind} cudnn"], res[n]))
                    emit(f"   {n:13s} vs cudnn per-round gain median {r[len(r)//2]:+.1%} range [{r[0]:+.1%}, {r[-1]:+.1%}]")
for kern in (FWD, WS, DQ, DKDV):
    for kk, vv in kern.cache.items():
        emit(f"{kern.base_fn.__name__} {kk} {vv}")
with open(f"{out_dir}/ab_dense.log", "w") as f:
    f.write("\n".join(rows) + "\n")
