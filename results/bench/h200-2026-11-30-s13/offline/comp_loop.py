"""Offline sm_90 compile of a general backward kernel (TMA on): regs, spills, waits, SASS loop order."""
import sys, re, subprocess, os, importlib
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/tmp/proto")
mod = importlib.import_module(sys.argv[1]); fn = getattr(mod, sys.argv[2])
D, BM, BN, W, S = (int(x) for x in sys.argv[3:8])
extra = {a.split("=")[0]: int(a.split("=")[1]) for a in sys.argv[8:]}
BIN = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
const = {"HEAD_DIM": D, "LOG_BIAS": True, "SIGMOID": 1, "DOT_PRECISION": "tf32", "BLOCK_M": BM, "BLOCK_N": BN, "TMA": 1, "LOOKAHEAD": 0, "A_REGS": 0, "S_FIRST": 0}
const.update(extra)
names = fn.arg_names
blk = lambda b: f"tensordesc<bf16[1,1,{b},{D}]>"
descs = {"Q_d": blk(BM), "DO_d": blk(BM), "K_d": blk(BN), "V_d": blk(BN)}
const = {k: v for k, v in const.items() if k in names}
s = {}
for n in names:
    if n in const: s[n] = "constexpr"
    elif n in descs: s[n] = descs[n]
    elif n == "LENS": s[n] = "*i32"
    elif n in ("Q", "K", "V", "DO", "DQ", "DK", "DV", "Out"): s[n] = "*bf16"
    elif n == "MX": s[n] = "*fp32"
    elif n in ("scale", "bias"): s[n] = "fp32"
    else: s[n] = "i32"
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in s.items() if (t.startswith("*") or t == "i32") and n not in ("H", "T", "T_BUCKET")}
src = ASTSource(fn, s, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": W, "num_stages": S})
tag = sys.argv[2] + "_" + "_".join(sys.argv[3:])
open(f"/tmp/off/{tag}.ptx", "w").write(k.asm["ptx"])
open(f"/tmp/off/{tag}.ttgir", "w").write(k.asm["ttgir"])
r = subprocess.run([BIN + "/ptxas", "-v", "-arch=sm_90a", f"/tmp/off/{tag}.ptx", "-o", f"/tmp/off/{tag}.cubin"], capture_output=True, text=True)
regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1)); sp = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
sass = subprocess.run([BIN + "/cuobjdump", "-sass", f"/tmp/off/{tag}.cubin"], capture_output=True, text=True).stdout
open(f"/tmp/off/{tag}.sass", "w").write(sass)
ins = re.findall(r"/\*([0-9a-f]+)\*/\s+([^;]*);", sass)
# loop bodies: backward branches
seq = []
for a, i in ins:
    m = re.search(r"BRA.*0x([0-9a-f]+)", i)
    if m and int(m.group(1), 16) < int(a, 16) and int(a, 16) - int(m.group(1), 16) > 0x400:
        lo, hi = int(m.group(1), 16), int(a, 16)
        ops = []
        for b, x in ins:
            if lo <= int(b, 16) <= hi:
                op = re.sub(r"^@!?U?P\w+\s+", "", x.strip()).split()[0]
                if op.startswith(("HGMMA", "WARPGROUP", "MUFU", "SYNCS.PHASECHK", "BAR")):
                    op = op.split(".")[0] + ("." + op.split(".")[1] if op.startswith("WARPGROUP") else "")
                    if ops and ops[-1][0] == op: ops[-1][1] += 1
                    else: ops.append([op, 1])
                elif op.startswith(("FFMA", "FMUL", "FADD", "F2FP")):
                    o = "FP32"
                    if ops and ops[-1][0] == o: ops[-1][1] += 1
                    else: ops.append([o, 1])
        seq.append((hex(lo), hex(hi), (hi - lo) // 16, " ".join(f"{o}x{c}" for o, c in ops)))
waits = re.findall(r"pendings = (\d+)", k.asm["ttgir"])
print(f"{tag}: regs {regs} spills {sp} smem {k.metadata.shared} waits {waits}")
for x in seq: print("  loop", x[0], x[1], x[2], "instr:", x[3][:900])
