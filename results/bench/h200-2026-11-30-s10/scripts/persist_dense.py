"""Session 10: a persistent dense forward generated from the committed dense kernel's source (the
body wrapped in a loop over (b, h, query tile) tiles, round-robin over the programs), against the
op (dense kernels at hd 128, autotuned) and SDPA cuDNN. One process, interleaved rounds, do_bench
medians.   python3 persist_dense.py OUTDIR ROUNDS      (CPU check: CHECK=1 TRITON_INTERPRET=1)"""
import importlib, inspect, math, os, sys
import torch, triton

sd = importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")

src = inspect.getsource(sd._sigmoid_fwd_dense_kernel.fn)
head, rest = src.split("    pid_m = tl.program_id(0)\n    pid_bh = tl.program_id(1)\n")
head = head.replace("def _sigmoid_fwd_dense_kernel(", "def _fwd_dense_persist(").replace(
    "H, T, T_BUCKET, mx_stride, scale, bias,", "H, T, T_BUCKET, mx_stride, scale, bias, N_M, N_TILES,")
loop = ("    for tile in tl.range(tl.program_id(0), N_TILES, tl.num_programs(0)):\n"
        "        pid_bh = tile // N_M\n        pid_m = tile - pid_bh * N_M\n")
body = "\n".join(("    " + l if l.strip() else l) for l in rest.split("\n"))
gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
os.makedirs(gen, exist_ok=True)
with open(f"{gen}/k_dense_persist.py", "w") as f:
    f.write("import triton\nimport triton.language as tl\n\n" + head + loop + body + "\n")
sys.path.insert(0, gen)
persist = importlib.import_module("k_dense_persist")._fwd_dense_persist


def launch(kern, q, k, v, L, cfg, a_regs, n_prog=None, return_max=False):
    B, H, T, D = q.shape
    out = sa._empty_bthd_as_bhtd(q)
    n_m = triton.cdiv(T, cfg["BLOCK_M"])
    mx = torch.zeros(B * H, n_m, dtype=torch.float32, device=q.device)
    desc = sd.descriptors(Q=q, K=k, V=v)
    sd.set_blocks({**desc, **cfg})
    args = [out, mx, L, *out.stride()[:3], H, T, sa.seq_bucket(T), n_m, 1 / math.sqrt(D), 0.0]
    grid = (n_m, B * H)
    if n_prog is not None:
        args += [n_m, n_m * B * H]
        grid = (min(n_prog, n_m * B * H),)
    kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.EXACT if os.environ.get("TRITON_INTERPRET") else sa.TANH_F32,
              RETURN_MAX=return_max, DOT_PRECISION="tf32", A_REGS=a_regs, **desc)
    run_cfg = {n: cfg[n] for n in ("BLOCK_M", "BLOCK_N")}
    if not os.environ.get("TRITON_INTERPRET"):
        run_cfg.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    kern[grid](*args, **kw, **run_cfg)
    return out, mx


if os.environ.get("CHECK"):
    torch.manual_seed(0)
    for T, n_prog in ((37, 3), (64, 5), (100, 1)):
        q, k, v = (torch.randn(2, 3, T, 64) for _ in range(3))
        L = torch.full((2,), T, dtype=torch.int32)
        cfg = dict(BLOCK_M=32, BLOCK_N=16)
        a, ma = launch(sd._sigmoid_fwd_dense_kernel, q, k, v, L, cfg, False, return_max=True)
        b, mb = launch(persist, q, k, v, L, cfg, False, n_prog, return_max=True)
        print(T, n_prog, "equal out", torch.equal(a, b), "equal max", torch.equal(ma, mb))
    sys.exit()

if __name__ == "__main__":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
    out_dir, rounds = sys.argv[1], int(sys.argv[2])
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(sa._device_allocator)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "SMs", n_sm, flush=True)
    lines = []
    for T in (4096, 8192, 16384):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, 128, 0.0)
        q, k, v = (t.detach() for t in (q, k, v))
        B, H = q.shape[:2]
        fl = flops_fwd(H, 128, L.tolist())
        fns, outs = {}, {}
        fns["op"] = lambda: sa.sigmoid_attention(q, k, v, L)
        outs["op"] = sa.sigmoid_attention(q, k, v, L)[0]

        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        fns["cudnn"] = cud
        for cfg in (dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)):
            for kind, n_prog in (("grid", None), ("persist", n_sm), ("persist2", 2 * n_sm)):
                if kind == "persist2" and cfg["BLOCK_N"] == 128:
                    continue
                n = f"{kind} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}"
                kern = sd._sigmoid_fwd_dense_kernel if n_prog is None else persist
                f = (lambda kern=kern, cfg=cfg, n_prog=n_prog: launch(kern, q, k, v, L, cfg, True, n_prog))
                try:
                    outs[n] = f()[0]; torch.cuda.synchronize()
                except Exception as e:
                    print(f"T={T} {n}: {type(e).__name__} {str(e)[:160]}", flush=True)
                    continue
                fns[n] = f
        same = {n: torch.equal(o, outs["op"]) for n, o in outs.items()}
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            ts = times[n]
            ratio = sorted(times["cudnn"][i] / ts[i] for i in range(rounds))[rounds // 2]
            ms = sorted(ts)[rounds // 2]
            line = (f"T={T:5d} {n:18s} {fl / ms * 1e-9:6.1f} TFLOPS  vs cudnn {100 * (ratio - 1):+5.1f}%"
                    f"  same-as-op {same.get(n, '-')}")
            print(line, flush=True)
            lines.append(line)
        del q, k, v
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    open(f"{out_dir}/persist_dense.log", "w").write("\n".join(lines) + "\n")
