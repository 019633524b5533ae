"""Key-loop size and the opcodes that differ, dense vs general forward (SASS written by comp_dense.py
to /tmp/off/{dense,general}{64,128}.sass). The key loop is the first backward branch's body."""
import collections, re


def body(name):
    ins = re.findall(r"/\*([0-9a-f]+)\*/\s+([^;]*);", open(f"/tmp/off/{name}.sass").read())
    for a, i in ins:
        m = re.search(r"BRA.*0x([0-9a-f]+)", i)
        if m and int(m.group(1), 16) < int(a, 16):
            lo, hi = int(m.group(1), 16), int(a, 16)
            ops = [re.sub(r"^@!?U?P\w+\s+", "", x.strip()).split()[0].split(".")[0]
                   for b, x in ins if lo <= int(b, 16) <= hi]
            return collections.Counter(ops)


for D in (64, 128):
    d, g = body(f"dense{D}"), body(f"general{D}")
    print(f"D={D}: key loop {sum(d.values())} instructions (dense) vs {sum(g.values())} (general)")
    for k in sorted(set(d) | set(g)):
        if d[k] != g[k]:
            print(f"   {k:8s} dense {d[k]:3d}  general {g[k]:3d}")
