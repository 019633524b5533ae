import sys, re, importlib
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "/work/main")
sd = importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")
fn = sd._sigmoid_fwd_dense_kernel
D, BM, BN = (int(sys.argv[2]), 128, 128) if len(sys.argv) > 2 else (128, 128, 128)
const = {"HEAD_DIM": D, "LOG_BIAS": True, "SIGMOID": 1, "DOT_PRECISION": "tf32", "A_REGS": int(sys.argv[1]) if len(sys.argv) > 1 else 1, "RETURN_MAX": 0, "BLOCK_M": BM, "BLOCK_N": BN}
blk = lambda b: f"tensordesc<bf16[1,1,{b},{D}]>"
descs = {"Q_d": blk(BM), "K_d": blk(BN), "V_d": blk(BN)}
names = fn.arg_names; s = {}
for n in names:
    if n in const: s[n] = "constexpr"
    elif n in descs: s[n] = descs[n]
    elif n == "LENS": s[n] = "*i32"
    elif n in ("Out", "MX"): s[n] = "*bf16" if n == "Out" else "*fp32"
    elif n in ("scale", "bias"): s[n] = "fp32"
    else: s[n] = "i32"
src = ASTSource(fn, s, constexprs={(names.index(k),): v for k, v in const.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
for l in k.asm["ttgir"].splitlines():
    if re.search(r"warp_group_dot|scf.for |scf.yield|inline_asm", l): print(l.strip()[:170])
import subprocess, os
BIN = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
open("/tmp/off/fwd.ptx", "w").write(k.asm["ptx"])
subprocess.run([BIN + "/ptxas", "-arch=sm_90a", "/tmp/off/fwd.ptx", "-o", "/tmp/off/fwd.cubin"], check=True)
sass = subprocess.run([BIN + "/cuobjdump", "-sass", "/tmp/off/fwd.cubin"], capture_output=True, text=True).stdout
open("/tmp/off/fwd.sass", "w").write(sass)
