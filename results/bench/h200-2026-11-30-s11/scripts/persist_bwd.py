"""Session 11: persistent dense backward kernels (dQ and dK/dV), generated from the committed dense
kernels' source (the body wrapped in a loop over (b, h, tile) units, round-robin over the
programs), against the same kernels one program per tile, the op's backward kernels
(``backward_auto``: dense at hd 128, general at hd 64) and SDPA cuDNN's backward. One process,
interleaved rounds, do_bench medians.
    python3 persist_bwd.py OUTDIR ROUNDS          (CPU check: CHECK=1 TRITON_INTERPRET=1)"""
import importlib, inspect, math, os, sys
import torch, triton

sd = importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
INTERP = bool(os.environ.get("TRITON_INTERPRET"))
gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
os.makedirs(gen, exist_ok=True)


def make_persistent(kernel, pid_tile: str, new_name: str) -> str:
    src = inspect.getsource(kernel.fn)
    sig_old = "H, T, T_BUCKET, scale, bias,"
    marker = f"    {pid_tile} = tl.program_id(0)\n    pid_bh = tl.program_id(1)\n"
    head, rest = src.split(marker)
    assert sig_old in head, head
    head = head.replace(f"def {kernel.fn.__name__}(", f"def {new_name}(").replace(
        sig_old, "H, T, T_BUCKET, scale, bias, N_T, N_UNITS,")
    loop = ("    for unit in tl.range(tl.program_id(0), N_UNITS, tl.num_programs(0)):\n"
            f"        pid_bh = unit // N_T\n        {pid_tile} = unit - pid_bh * N_T\n")
    body = "\n".join(("    " + l if l.strip() else l) for l in rest.split("\n"))
    return head + loop + body + "\n"


src = "import triton\nimport triton.language as tl\n\n"
src += make_persistent(sd._sigmoid_bwd_dq_dense_kernel, "pid_m", "_dq_persist") + "\n\n"
src += make_persistent(sd._sigmoid_bwd_dkdv_dense_kernel, "pid_n", "_dkdv_persist")
with open(f"{gen}/k_bwd_persist.py", "w") as f:
    f.write(src)
sys.path.insert(0, gen)
mod = importlib.import_module("k_bwd_persist")
DQ_P, DKDV_P = mod._dq_persist, mod._dkdv_persist


def launch(do, q, k, v, L, cfg_dq, cfg_dkdv, n_prog=None):
    """(dq, dk, dv) from the dense kernels (n_prog None) or their persistent twins."""
    B, H, T, D = q.shape
    common = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.EXACT if INTERP else sa.TANH_F32,
                  DOT_PRECISION="tf32")
    desc = sd.descriptors(Q=q, K=k, V=v, DO=do)
    scale = 1 / math.sqrt(D)
    out = []
    for kind, cfg in (("dq", cfg_dq), ("dkdv", cfg_dkdv)):
        sd.set_blocks({**desc, **cfg})
        tile = cfg["BLOCK_M"] if kind == "dq" else cfg["BLOCK_N"]
        n_t = triton.cdiv(T, tile)
        if kind == "dq":
            dq = sa._empty_bthd_as_bhtd(q)
            args = [dq, L, *dq.stride()[:3], H, T, sa.seq_bucket(T), scale, 0.0]
            kern = sd._sigmoid_bwd_dq_dense_kernel if n_prog is None else DQ_P
            out.append(dq)
        else:
            dk, dv = sa._empty_bthd_as_bhtd(k), sa._empty_bthd_as_bhtd(v)
            args = [dk, dv, L, *dk.stride()[:3], *dv.stride()[:3], H, T, sa.seq_bucket(T), scale, 0.0]
            kern = sd._sigmoid_bwd_dkdv_dense_kernel if n_prog is None else DKDV_P
            out += [dk, dv]
        grid = (n_t, B * H)
        if n_prog is not None:
            n = n_prog[kind] if isinstance(n_prog, dict) else n_prog
            args += [n_t, n_t * B * H]
            grid = (min(n, n_t * B * H),)
        run_cfg = {n_: cfg[n_] for n_ in ("BLOCK_M", "BLOCK_N")}
        if not INTERP:
            run_cfg.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        kern[grid](*args, **common, **desc, **run_cfg)
    return tuple(out)


if os.environ.get("CHECK"):
    torch.manual_seed(0)
    for T, n_prog in ((37, 3), (64, 5), (100, 1)):
        q, k, v, do = (torch.randn(2, 3, T, 64) for _ in range(4))
        L = torch.full((2,), T, dtype=torch.int32)
        cfg = dict(BLOCK_M=32, BLOCK_N=16)
        a = launch(do, q, k, v, L, cfg, cfg)
        b = launch(do, q, k, v, L, cfg, cfg, n_prog)
        print(T, n_prog, "equal", [torch.equal(x, y) for x, y in zip(a, b)])
    sys.exit()

if __name__ == "__main__":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
    from stabilitylab.kernels.triton_support import autotune_choices
    out_dir, rounds = sys.argv[1], int(sys.argv[2])
    head_dims = [int(x) for x in os.environ.get("HDS", "128 64").split()]
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(sa._device_allocator)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "SMs", n_sm, flush=True)
    C = lambda m, n, w, s: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
    lines = []
    for D in head_dims:
        dkdv_cfg = C(64, 128, 8, 3) if D == 128 else C(64, 64, 4, 3)
        dq_cfg = C(128, 64, 8, 3)
        variants = {"grid": None, "persist x1": n_sm, "persist x2": 2 * n_sm}
        if D == 64:
            variants["persist dq1 dkdv2"] = {"dq": n_sm, "dkdv": 2 * n_sm}
            variants["persist dq1 dkdv3"] = {"dq": n_sm, "dkdv": 3 * n_sm}
        for T in (4096, 8192, 16384):
            torch.manual_seed(0)
            q, k, v, L = make_inputs(T, D, 0.0)
            B, H = q.shape[:2]
            fl = 2.5 * flops_fwd(H, D, L.tolist())
            out = sa.sigmoid_attention(q, k, v, L)[0]
            g = torch.randn_like(out)
            qd, kd, vd = (t.detach() for t in (q, k, v))
            do = g
            fns = {}
            fns["op grad"] = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out_c = F.scaled_dot_product_attention(q, k, v)
            fns["cudnn grad"] = lambda: torch.autograd.grad(out_c, (q, k, v), g, retain_graph=True)
            args = (do, qd, kd, vd, L, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32)
            fns["op kernels"] = lambda: sa.backward_auto(*args)
            ref = sa.backward_auto(*args)
            same = {}
            for name, n_prog in variants.items():
                f = (lambda n_prog=n_prog: launch(do, qd, kd, vd, L, dq_cfg, dkdv_cfg, n_prog))
                try:
                    res = f(); torch.cuda.synchronize()
                except Exception as e:
                    print(f"D={D} T={T} {name}: {type(e).__name__} {str(e)[:160]}", flush=True)
                    continue
                fns[name] = f
                if name == "grid":
                    grid_res = res
                same[name] = all(torch.equal(x, y) for x, y in zip(res, grid_res))
                same[name + " ~op"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(res, ref))
            for f in fns.values():
                f()
            times = {n: [] for n in fns}
            for _ in range(rounds):
                for n, f in fns.items():
                    times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
            med = lambda xs: sorted(xs)[len(xs) // 2]
            for n in fns:
                ts = times[n]
                vs_grid = med([times["grid"][i] / ts[i] for i in range(rounds)]) if "grid" in times else float("nan")
                vs_opk = med([times["op kernels"][i] / ts[i] for i in range(rounds)])
                # op grad with these kernels in place of the op's: its host/other share stays
                est = med([times["cudnn grad"][i] / (times["op grad"][i] - times["op kernels"][i] + ts[i])
                           for i in range(rounds)])
                line = (f"D={D} T={T:5d} {n:18s} {med(ts):7.3f} ms {fl / med(ts) * 1e-9:6.1f} TFLOPS"
                        f"  vs grid {100 * (vs_grid - 1):+5.1f}%  vs op-kernels {100 * (vs_opk - 1):+5.1f}%"
                        f"  est. op-with-it vs cudnn {100 * (est - 1):+5.1f}%"
                        f"  bitwise=grid {same.get(n, '-')}  maxdiff~op {same.get(n + ' ~op', '-')}")
                print(line, flush=True)
                lines.append(line)
            del q, k, v, out, out_c, g
            torch.cuda.empty_cache()
    print(autotune_choices(sa._TUNED))
    os.makedirs(out_dir, exist_ok=True)
    open(f"{out_dir}/persist_bwd.log", "w").write("\n".join(lines) + "\n")
