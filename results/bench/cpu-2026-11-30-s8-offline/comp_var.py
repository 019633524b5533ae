import sys, importlib
sys.path.insert(0, "/tmp"); sys.path.insert(0, "/tmp/off")
import comp
mod, fn, D, S = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
comp.m._sigmoid_fwd_kernel = getattr(importlib.import_module(mod), fn)
regs, sp, agg, sass = comp.compile_one("fwd", D, 1, 128, 64, 8, S)
open(f"/tmp/off/{mod}_{D}.sass", "w").write(sass)
print(mod, D, "regs", regs, "spills", sp, "total", sum(agg.values()))
