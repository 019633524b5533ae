import sys, os, re, subprocess, collections, importlib
sys.path.insert(0, "/work/main/.dev/s8/gen"); sys.path.insert(0, "/tmp/off")
import comp
kp = importlib.import_module("k_persist")._fwd_persist
comp.m._sigmoid_fwd_kernel = kp
regs, sp, agg, sass = comp.compile_one("fwd", int(sys.argv[1]), 1, 128, 64, 8, int(sys.argv[2]))
open("/tmp/off/persist.sass", "w").write(sass)
print("persist regs", regs, "spills", sp, "total", sum(agg.values()))
