"""Generate a variant of the committed forward kernel whose TMA path loads q with pointer loads
issued before the k and v descriptors are built (no q descriptor), so that q's latency overlaps
the descriptor builds."""
import importlib, inspect, sys

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")

QDESC = """            q_desc = tl.make_tensor_descriptor(
                q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
"""
QPTR = """            q = tl.load(
                q_base + offs_m[:, None] * sqt + offs_d[None, :], mask=offs_m[:, None] < L, other=0.0
            )
"""


def generate(path):
    src = inspect.getsource(sa._sigmoid_fwd_kernel.fn)
    assert QDESC in src
    src = src.replace(QDESC, QPTR).replace("            q = q_desc.load([start_m, 0])\n", "")
    src = src.replace("def _sigmoid_fwd_kernel(", "def _fwd_qptr(")
    assert "q_desc" not in src
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n" + src + "\n")


if __name__ == "__main__":
    generate(sys.argv[1])
