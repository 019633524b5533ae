"""Session 5: compile the experimental fused backward (../../h200-2026-11-29-s5/fused_bwd/fused_bwd.py)
for sm_90 with the triton 3.6 wheel, no GPU: shared memory per config and the atomics in its PTX.
Run: v/bin/python fused_ptx_check.py (v: a venv with triton==3.6.0); output in fused_ptx_check.log."""
import ast, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "h200-2026-11-29-s5", "fused_bwd", "fused_bwd.py")
src = open(SRC).read()
node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_bwd_fused")
with open(os.path.join(HERE, "k_fused.py"), "w") as f:
    f.write("import triton\nimport triton.language as tl\n\n"
            + "\n".join(src.splitlines()[node.decorator_list[0].lineno - 1 : node.end_lineno]) + "\n")
sys.path.insert(0, HERE)
import triton, k_fused  # noqa: E402
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
fn = k_fused._bwd_fused
sig = {}
for n in fn.arg_names:
    sig[n] = "*bf16" if n in ("Q","K","V","DO","DK","DV") else "*fp32" if n == "DQA" else "*i32" if n == "LENS" else "fp32" if n == "scale" else "i32"
div = [n for n in fn.arg_names if n not in ("scale",) and n not in ("HEAD_DIM","SIGMOID","TMA","BLOCK_M","BLOCK_N")]
for tma in (True, False):
    for cfg in [(64,128,8,3),(64,128,8,2),(32,128,4,3),(64,64,4,3),(128,128,8,2)]:
        c = dict(HEAD_DIM=128, SIGMOID=1, TMA=tma, BLOCK_M=cfg[0], BLOCK_N=cfg[1])
        s = {n: ("constexpr" if n in c else sig[n]) for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
        try:
            k = triton.compile(ASTSource(fn, s, constexprs=c, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg[2], num_stages=cfg[3]))
            ptx = k.asm["ptx"]
            import re
            reds = sorted(set(re.findall(r"(?:red|atom)\.[a-z0-9_.:]+", ptx)))
            print(tma, cfg, "smem", k.metadata.shared, "atomics", reds[:4], "count", len(re.findall(r"(?:red|atom)\.global", ptx)))
        except Exception as e:
            print(tma, cfg, "FAIL", type(e).__name__, str(e)[:200])
