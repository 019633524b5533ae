"""Writes gen/old_fwd.py beside this script, which fold_ab.py imports (as `.dev/s7/gen/` when it ran):
the committed forward kernel of 64c2d79's kernels/sigmoid_attention.py, renamed `_fwd_old`, byte for
byte the file call 9 ran. Needs git.   python3 make_old_fwd.py"""
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
src = subprocess.run(["git", "-C", REPO, "show", "64c2d79:kernels/sigmoid_attention.py"],
                     capture_output=True, text=True, check=True).stdout
i = src.index("@triton.jit\ndef _sigmoid_fwd_kernel(")
j = src.index("@triton.jit", i + 10)
body = src[i:j].replace("def _sigmoid_fwd_kernel(", "def _fwd_old(")
os.makedirs(os.path.join(HERE, "gen"), exist_ok=True)
with open(os.path.join(HERE, "gen", "old_fwd.py"), "w") as f:
    f.write("import triton\nimport triton.language as tl\n\n\n" + body)
