"""Session 5: compile the persistent-forward variants for sm_90 without a GPU, with the triton 3.6
wheel (the H200 image's version): python3 -m venv v && v/bin/pip install triton==3.6.0 &&
v/bin/python comp.py. Writes <tag>.ttgir / <tag>.ptx beside it. Tags: pers / grid = the integrated
kernel (persistent_integrated.patch) with PERSISTENT True / False; now = the committed kernel;
exp / exp0 = the experimental `_fwd_persist` (../h200-2026-11-29-s5/persist_fwd2/persist.py) with
FLATTEN True / False.
Specialisation as at the bench shapes (strides, T, H, BH divisible by 16; mx_stride = 1).
ptxas -arch=sm_90a -v on the PTX: exp 189 registers, pers 191, grid 172, now 173; no spills."""
import sys, importlib, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402
import ast

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def extract(path, name, module):
    """Write the @triton.jit function ``name`` of ``path`` alone into HERE/<module>.py (Triton needs
    a source file for it)."""
    src = open(path).read()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = src.splitlines()[node.decorator_list[0].lineno - 1 : node.end_lineno]
    with open(os.path.join(HERE, module + ".py"), "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n" + "\n".join(lines) + "\n")


def integrated_source() -> str:
    """kernels/sigmoid_attention.py of c78f5b6 with persistent_integrated.patch applied (needs git
    and patch): the integrated persistent kernel, which no committed file holds."""
    import subprocess
    import tempfile

    patch = os.path.join(REPO, "results", "bench", "h200-2026-11-29-s5", "bardiag_persistent",
                         "persistent_integrated.patch")
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "kernels"))
        for rel in ("kernels/sigmoid_attention.py", "kernels/triton_support.py",
                    "kernels/sweep_configs.py", "tests/test_kernels.py"):
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(tmp, rel), "w") as f:
                subprocess.run(["git", "-C", REPO, "show", f"c78f5b6:{rel}"], stdout=f, check=True)
        subprocess.run(["patch", "-s", "-p1", "-i", patch], cwd=tmp, check=True)
        path = os.path.join(HERE, "sa_integrated.py")
        with open(os.path.join(tmp, "kernels", "sigmoid_attention.py")) as src, open(path, "w") as f:
            f.write(src.read())
    return path


# The kernels compiled, cut from the files they live in (k_*.py are written beside this script).
extract(integrated_source(), "_sigmoid_fwd_kernel", "k_pers")
extract(os.path.join(REPO, "kernels", "sigmoid_attention.py"), "_sigmoid_fwd_kernel", "k_now")
extract(os.path.join(REPO, "results", "bench", "h200-2026-11-29-s5", "persist_fwd2", "persist.py"),
        "_fwd_persist", "k_exp")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(modname, fname, sig_types, consts, div16, warps=8, stages=3):
    mod = importlib.import_module(modname)
    fn = getattr(mod, fname)
    names = fn.arg_names
    signature = {}
    for n in names:
        if n in consts:
            signature[n] = "constexpr"
        else:
            signature[n] = sig_types[n]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn, signature, constexprs={n: v for n, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return k

ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "MX": "*fp32", "LENS": "*i32"}
ints = ["sqb","sqh","sqt","skb","skh","skt","svb","svh","svt","sob","soh","sot","H","T","T_BUCKET","BH","n_m","n_tiles","mx_stride"]
sig = dict(ptr); sig.update({n: "i32" for n in ints}); sig.update(scale="fp32", bias="fp32")
common = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64)
div = ["Q","K","V","Out","MX","LENS","sqb","sqh","sqt","skb","skh","skt","svb","svh","svt","sob","soh","sot","H","T","T_BUCKET","BH","n_m","n_tiles"]
out = {}
c_pers = dict(common, LOG_BIAS=True, SIGMOID=1, RETURN_MAX=False, DOT_PRECISION="tf32", TMA=True, LOOKAHEAD=True, PERSISTENT=True, mx_stride=1)
c_grid = dict(c_pers, PERSISTENT=False)
c_now = dict(common, LOG_BIAS=True, SIGMOID=1, RETURN_MAX=False, DOT_PRECISION="tf32", TMA=True, LOOKAHEAD=True, mx_stride=1)
c_exp = dict(common, TMA=True, FLATTEN=True)
for tag, mod, fname, c in [("pers", "k_pers", "_sigmoid_fwd_kernel", c_pers), ("grid", "k_pers", "_sigmoid_fwd_kernel", c_grid),
                           ("now", "k_now", "_sigmoid_fwd_kernel", c_now), ("exp", "k_exp", "_fwd_persist", c_exp),
                           ("exp0", "k_exp", "_fwd_persist", dict(c_exp, FLATTEN=False))]:
    fn = getattr(importlib.import_module(mod), fname)
    d = [n for n in div if n in fn.arg_names and n not in c]
    try:
        k = build(mod, fname, sig, c, d)
        for ext in ("ttgir", "ptx"):
            open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{tag}.{ext}"), "w").write(k.asm[ext])
        print(tag, "ok", "regs", k.n_regs if hasattr(k, "n_regs") else "?", "smem", k.metadata.shared)
    except Exception as e:
        import traceback; traceback.print_exc()
        print(tag, "fail", type(e).__name__, str(e)[:300])
