"""Writes k_hd_tail.py and k_hd_notail.py beside this script, which ab3.py imports: the forward
kernel of host_descriptors.patch (applied to acb2de2's kernels/sigmoid_attention.py), with its
masked-tail block and without it. Needs git and patch. python3 make_k_hd.py"""
import ast
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
HEADER = "import triton\nimport triton.language as tl\n\n"

with tempfile.TemporaryDirectory() as tmp:
    for rel in ("kernels/sigmoid_attention.py", "kernels/triton_support.py", "tests/test_kernels.py"):
        os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(tmp, rel), "w") as f:
            subprocess.run(["git", "-C", REPO, "show", f"acb2de2:{rel}"], stdout=f, check=True)
    subprocess.run(["patch", "-s", "-p1", "-i", os.path.join(HERE, "host_descriptors.patch")],
                   cwd=tmp, check=True)
    src = open(os.path.join(tmp, "kernels", "sigmoid_attention.py")).read()
node = next(n for n in ast.parse(src).body
            if isinstance(n, ast.FunctionDef) and n.name == "_sigmoid_fwd_kernel")
body = "\n".join(src.splitlines()[node.decorator_list[0].lineno - 1 : node.end_lineno])
tail = body.index("        if TMA:\n            if n_main < L:")
end = body.index("    # Padded query rows saw q = 0")
with open(os.path.join(HERE, "k_hd_tail.py"), "w") as f:
    f.write(HEADER + body + "\n")
with open(os.path.join(HERE, "k_hd_notail.py"), "w") as f:
    f.write(HEADER + body[:tail] + body[end:] + "\n")
