# Session 5 host-time probe (CPU, this repository's CI-class machine, triton 3.9, torch 2.13 CPU):
# the launch itself is stubbed out (Tuned.launch = no-op) and the module is told it runs on sm90
# (capability (9, 0), not interpreting), so every host step of the op runs except Triton's own launch.
# Run as: TRITON_INTERPRET=1 python host_cpu.py, alternating the HEAD (c78f5b6) and new
# kernels/sigmoid_attention.py + kernels/triton_support.py, 3 rounds each (host_cpu.log).
import os, time, cProfile, pstats, torch, importlib
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels import sigmoid_attention
import stabilitylab.kernels.triton_support as ts
sa.interpreting = lambda: False
sa.capability = lambda dev: (9, 0)
ts.Tuned.launch = lambda self, grid, key, *a, **k: None
B,H,T,D = 1,2,256,128
qkv = torch.randn(B,T,3,H,D, dtype=torch.bfloat16)
q,k,v = (qkv[:,:,i].permute(0,2,1,3) for i in range(3))
q.requires_grad_(False)
lengths = torch.full((B,), T, dtype=torch.int32)
def bench(name, fn, n=2000):
    for _ in range(50): fn()
    t=time.perf_counter()
    for _ in range(n): fn()
    print(f"{name:30s} {(time.perf_counter()-t)/n*1e6:7.1f} us")
bench("sigmoid_attention no grad", lambda: sigmoid_attention(q,k,v,lengths))
bench("check_attention_inputs", lambda: ts.check_attention_inputs({"q":q,"k":k,"v":v}, lengths, None, None))
bench("forward_auto", lambda: sa.forward_auto(q,k,v,lengths,0.1,0.0,True,1,False))
bench("backward_auto", lambda: sa.backward_auto(q,q,k,v,lengths,0.1,0.0,True,1))

qg,kg,vg=(t.detach().clone().requires_grad_() for t in (q,k,v))
def fb():
    o,_=sigmoid_attention(qg,kg,vg,lengths)
    torch.autograd.grad(o,(qg,kg,vg),o, retain_graph=False)
bench("fwd+autograd.grad", fb, 500)
for _ in range(500): sa.backward_auto(q,q,k,v,lengths,0.1,0.0,True,1)
