import sys, importlib
sys.path.insert(0, "/tmp"); sys.path.insert(0, "/tmp/off")
import comp
src = open("/tmp/k_committed.py").read()
start = src.index("@triton.jit\ndef _sigmoid_fwd_kernel(")
end = src.index("@triton.jit\ndef _sigmoid_bwd_dq_kernel(")
k = src[start:end]
v = sys.argv[1]
if v == "storein":
    a = """    # Padded query rows saw q = 0, so acc holds sigmoid(b) * sum(v) there: zero them on the way out.
    acc = tl.where(offs_m[:, None] < L, acc, 0.0)
    tl.store(
        Out + b64 * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
        acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T,
    )  # fmt: skip
"""
    assert a in k
    k = k.replace(a, "")
    b = "            acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)\n"
    k = k.replace(b, b + "\n".join("    " + l if l else l for l in a.split("\n")))
if v == "accin":
    k = k.replace("""    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    mx = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # A query""", """    mx = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # A query""")
    k = k.replace("        qk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)\n", "        qk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)\n        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)\n", 1)
    k = k.replace("    acc = tl.where(offs_m[:, None] < L, acc, 0.0)", "    acc = tl.where(offs_m[:, None] < L, acc, 0.0) if start_m < L else tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)")
open("/tmp/k_bis2.py", "w").write("import triton\nimport triton.language as tl\n\n" + k)
comp.m._sigmoid_fwd_kernel = importlib.import_module("k_bis2")._sigmoid_fwd_kernel
r, sp, agg, sass = comp.compile_one("fwd", 64, 1, 128, 64, 8, 3)
open("/tmp/off/bis.sass", "w").write(sass)
print(v, "regs", r, "total", sum(agg.values()))
