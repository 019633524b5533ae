"""Generate an instrumented copy of the forward kernel (with Q_TILES): per query tile, %clock64 at
the tile's start, before its key loop, after it and after its store; per program, %globaltimer and
%clock64 at the start (so the descriptor builds of a Q_TILES > 1 program show as the time from the
program's start to its first tile). Rows of PROBE (n_programs * Q_TILES, 8) int64."""
import importlib, inspect, sys

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")


def asm(name, what, ty="l", dt="tl.int64"):
    return (f'{name} = tl.inline_asm_elementwise("mov.u64 $0, %{what};", "={ty},r", [pid_g], '
            f'dtype={dt}, is_pure=False, pack=1)')


def generate(path):
    src = inspect.getsource(sa._sigmoid_fwd_kernel.fn)
    src = src.replace("def _sigmoid_fwd_kernel(", "def _fwd_probe(").replace(
        "Q, K, V, Out, MX, LENS,", "Q, K, V, Out, MX, LENS, PROBE,")
    out = []
    lines = src.split("\n")
    i = 0
    while i < len(lines):
        l = lines[i]
        s = l.strip()
        ind = l[: len(l) - len(l.lstrip())]
        out.append(l)
        if s == "pid_bh = tl.program_id(1)":
            out += [ind + asm("g0", "globaltimer"), ind + asm("c0", "clock64")]
        elif s == "tile = pid_g * Q_TILES + g":
            out += [ind + asm("ct", "clock64"), ind + "c1 = ct"]
        elif s.startswith("for start_n in range(0, L, BLOCK_N):"):
            out.pop()
            out += [ind + asm("c1", "clock64"), l]
        elif s.startswith("# Padded query rows saw q = 0"):
            out.pop()
            out += [ind + asm("c2", "clock64"), l]
        elif s.startswith("acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)"):
            j = ind[:-9]  # the store's own indentation
            out += [j + asm("c3", "clock64"),
                    j + 'sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid_g], dtype=tl.int32, is_pure=False, pack=1)',
                    j + "pp = PROBE + ((pid_bh.to(tl.int64) * tl.num_programs(0) + pid_g) * Q_TILES + g) * 8",
                    j + "tl.store(pp + 0, g0)", j + "tl.store(pp + 1, ct - c0)", j + "tl.store(pp + 2, c1 - ct)",
                    j + "tl.store(pp + 3, c2 - c1)", j + "tl.store(pp + 4, c3 - c2)", j + "tl.store(pp + 5, sm.to(tl.int64))",
                    j + asm("g1", "globaltimer"), j + "tl.store(pp + 6, g1)"]
        i += 1
    new = "\n".join(out)
    assert new.count("%clock64") == 5 and "PROBE + " in new, new
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n" + new + "\n")


if __name__ == "__main__":
    generate(sys.argv[1])
