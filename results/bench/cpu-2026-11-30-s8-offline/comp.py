"""Offline sm_90 compile of the forward / dq / dkdv kernels: registers, spills, SASS op counts per mode."""
import sys, re, subprocess, os, collections, importlib
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
sys.path.insert(0, "/work/main")
m = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
BIN = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
target = GPUTarget("cuda", 90, 32)

def sig(names, ptrs, floats, ints64=()):
    out = {}
    for n in names:
        out[n] = "*bf16" if n in ptrs else ("fp32" if n in floats else "i32")
    return out

def compile_one(kind, D, mode, BM, BN, W, S, tma=None, look=None, rmax=False):
    tma = {"fwd": True, "dq": False, "dkdv": True}[kind] if tma is None else tma
    look = (kind == "fwd") if look is None else look
    fn = {"fwd": m._sigmoid_fwd_kernel, "dq": m._sigmoid_bwd_dq_kernel, "dkdv": m._sigmoid_bwd_dkdv_kernel}[kind]
    names = fn.arg_names
    const = {"HEAD_DIM": D, "LOG_BIAS": True, "SIGMOID": mode, "DOT_PRECISION": "tf32",
             "TMA": tma if os.environ.get("TMA") is None else os.environ["TMA"] == "1", "LOOKAHEAD": look, "BLOCK_M": BM, "BLOCK_N": BN, "A_REGS": os.environ.get("AREGS") == "1"}
    if kind == "fwd":
        const["RETURN_MAX"] = rmax
        if "Q_TILES" in names: const["Q_TILES"] = int(os.environ.get("QT", "2"))
    s = {}
    for n in names:
        if n in const: s[n] = "constexpr"
        elif n in ("MX",): s[n] = "*fp32"
        elif n == "LENS": s[n] = "*i32"
        elif n == "PROBE": s[n] = "*i64"
        elif n in ("Q","K","V","Out","DO","DQ","DK","DV"): s[n] = "*bf16"
        elif n in ("scale", "bias"): s[n] = "fp32"
        else: s[n] = "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in s.items() if (t.startswith("*") or t == "i32") and n not in ("mx_stride",) and os.environ.get("DIV", "1") == "1"}
    src = ASTSource(fn, s, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=target, options={"num_warps": W, "num_stages": S})
    cubin = k.asm["cubin"]
    open("/tmp/off/k.cubin", "wb").write(cubin)
    sass = subprocess.run([BIN + "/cuobjdump", "-sass", "/tmp/off/k.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M))
    agg = collections.Counter()
    for op, c in ops.items():
        agg[op.split(".")[0]] += c
    ptx = k.asm["ptx"]
    open("/tmp/off/k.ptx", "w").write(ptx)
    r = subprocess.run([BIN + "/ptxas", "-v", "-arch=sm_90a", "/tmp/off/k.ptx", "-o", "/tmp/off/k2.cubin"], capture_output=True, text=True)
    mm = re.search(r"Used (\d+) registers", r.stderr); sp = re.search(r"(\d+) bytes spill stores", r.stderr)
    return int(mm.group(1)), int(sp.group(1)), agg, sass

MODES = [int(x) for x in os.environ.get("MODES", "1 2").split()]
if __name__ == "__main__":
    kind, D, BM, BN, W, S = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:7])
    res = {}
    for mode in MODES:
        regs, spills, agg, sass = compile_one(kind, D, mode, BM, BN, W, S)
        open(f"/tmp/off/{kind}{D}_m{mode}.sass", "w").write(sass)
        res[mode] = agg
        print(f"{kind} D={D} {BM}x{BN}x{W}x{S} mode {mode}: regs {regs} spills {spills} total {sum(agg.values())}")

