"""Offline sm_90 compile: dense forward vs general forward at a config; registers, spills, loop size."""
import sys, re, subprocess, os, collections, importlib
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "/work/main")
sd = importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
BIN = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
target = GPUTarget("cuda", 90, 32)

def build(fn, const, descs, W, S):
    names = fn.arg_names
    s = {}
    for n in names:
        if n in const: s[n] = "constexpr"
        elif n in descs: s[n] = descs[n]
        elif n == "MX": s[n] = "*fp32"
        elif n == "LENS": s[n] = "*i32"
        elif n in ("Q","K","V","Out","DO","DQ","DK","DV"): s[n] = "*bf16"
        elif n in ("scale", "bias"): s[n] = "fp32"
        else: s[n] = "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in s.items() if (t.startswith("*") or t == "i32") and n != "mx_stride"}
    src = ASTSource(fn, s, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=target, options={"num_warps": W, "num_stages": S})
    ptx = k.asm["ptx"]; open("/tmp/off/kd.ptx", "w").write(ptx)
    r = subprocess.run([BIN + "/ptxas", "-v", "-arch=sm_90a", "/tmp/off/kd.ptx", "-o", "/tmp/off/kd.cubin"], capture_output=True, text=True)
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    sp = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
    smem = k.metadata.shared
    sass = subprocess.run([BIN + "/cuobjdump", "-sass", "/tmp/off/kd.cubin"], capture_output=True, text=True).stdout
    n_instr = len(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+\S", sass, re.M))
    return regs, sp, smem, n_instr, sass

D, BM, BN, W, S = (int(x) for x in sys.argv[1:6])
AR = D == 128
common = {"HEAD_DIM": D, "LOG_BIAS": True, "SIGMOID": 1, "DOT_PRECISION": "tf32", "A_REGS": AR, "RETURN_MAX": False, "BLOCK_M": BM, "BLOCK_N": BN}
blk = lambda b: f"tensordesc<bf16[1,1,{b},{D}]>"
r = build(sd._sigmoid_fwd_dense_kernel, common, {"Q_d": blk(BM), "K_d": blk(BN), "V_d": blk(BN)}, W, S)
open(f"/tmp/off/dense{D}.sass", "w").write(r[4])
print(f"dense   D={D} {BM}x{BN}x{W}x{S}: regs {r[0]} spills {r[1]} smem {r[2]} sass instr {r[3]}")
g = build(sa._sigmoid_fwd_kernel, {**common, "TMA": True, "LOOKAHEAD": True, "Q_TILES": 1}, {}, W, S)
open(f"/tmp/off/general{D}.sass", "w").write(g[4])
print(f"general D={D} {BM}x{BN}x{W}x{S}: regs {g[0]} spills {g[1]} smem {g[2]} sass instr {g[3]}")
