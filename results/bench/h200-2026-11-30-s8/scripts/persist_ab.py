"""Session 8: a persistent forward generated from the committed kernel's source (the body wrapped in
a loop over (b, h, query tile) tiles, round-robin over num_SM programs), against the committed
kernel launched directly (one tile per program), the op and SDPA cuDNN. One process, interleaved
rounds, do_bench medians.     python3 persist_ab.py OUTDIR ROUNDS"""
import importlib, inspect, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

src = inspect.getsource(sa._sigmoid_fwd_kernel.fn)
head, rest = src.split("    pid_m = tl.program_id(0)\n    pid_bh = tl.program_id(1)\n")
head = head.replace("def _sigmoid_fwd_kernel(", "def _fwd_persist(").replace(
    "H, T, T_BUCKET, mx_stride, scale, bias,", "H, T, T_BUCKET, mx_stride, scale, bias, N_M, N_TILES,")
loop = ("    for tile in tl.range(tl.program_id(0), N_TILES, tl.num_programs(0)):\n"
        "        pid_bh = tile // N_M\n        pid_m = tile - pid_bh * N_M\n")
body = "\n".join(("    " + l if l.strip() else l) for l in rest.split("\n"))
new = head + loop + body
gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
os.makedirs(gen, exist_ok=True)
with open(f"{gen}/k_persist.py", "w") as f:
    f.write("import triton\nimport triton.language as tl\n\n" + new + "\n")
sys.path.insert(0, gen)
k_persist = importlib.import_module("k_persist")._fwd_persist

if __name__ == "__main__":
    out_dir, rounds = sys.argv[1], int(sys.argv[2])
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(sa._device_allocator)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "SMs", n_sm, flush=True)
    lines = []
    for D in (128, 64):
        cfgs = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)]
        if D == 128:
            cfgs.append(dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4))
        for T, pad in ((4096, 0.0), (8192, 0.0), (16384, 0.0), (4096, 0.25), (16384, 0.25)):
            torch.manual_seed(0)
            q, k, v, L = make_inputs(T, D, pad)
            q, k, v = (t.detach() for t in (q, k, v))
            B, H = q.shape[:2]
            fl = flops_fwd(H, D, L.tolist())
            fns, outs = {}, {}
            fns["op"] = lambda: sa.sigmoid_attention(q, k, v, L)
            outs["op"] = sa.sigmoid_attention(q, k, v, L)[0]
            if pad == 0:
                def cud():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v)
                fns["cudnn"] = cud
            for cfg in cfgs:
                for a_regs in ((True, False) if D == 128 else (False,)):
                    for kind in ("grid", "persist"):
                        out = sa._empty_bthd_as_bhtd(q)
                        mx = torch.zeros(1, dtype=torch.float32, device="cuda")
                        n_m = triton.cdiv(T, cfg["BLOCK_M"])
                        kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False,
                                  DOT_PRECISION="tf32", TMA=True, LOOKAHEAD=True, A_REGS=a_regs, **cfg)
                        if kind == "grid":
                            args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
                            kern, grid = sa._sigmoid_fwd_kernel, (n_m, B * H)
                        else:
                            args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0,
                                                   n_m, n_m * B * H)
                            kern, grid = k_persist, (min(n_sm, n_m * B * H),)
                        f = (lambda kern=kern, args=args, kw=kw, grid=grid: kern[grid](*args, **kw))
                        n = f"{kind} s{cfg['num_stages']} aregs={int(a_regs)}"
                        try:
                            f(); torch.cuda.synchronize()
                        except Exception as e:
                            print(f"D={D} T={T} pad={pad} {n}: {type(e).__name__} {str(e)[:120]}", flush=True)
                            continue
                        fns[n] = f; outs[n] = out
            same = {n: torch.equal(o, outs["op"]) for n, o in outs.items()}
            times = {n: [] for n in fns}
            for _ in range(rounds):
                for n, f in fns.items():
                    times[n].append(triton.testing.do_bench(f, warmup=10, rep=50))
            for n in fns:
                ts = sorted(times[n]); ms = ts[len(ts) // 2]
                line = (f"D={D:3d} T={T:5d} pad={pad:.2f} {n:22s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS "
                        f"spread {(ts[-1]-ts[0])/ms:5.1%} same-as-op {same.get(n, '-')}")
                print(line, flush=True); lines.append(line)
    with open(f"{out_dir}/persist_ab.log", "w") as f:
        f.write("\n".join(lines) + "\n")
