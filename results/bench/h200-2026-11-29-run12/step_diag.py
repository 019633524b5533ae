import statistics, time, torch
from torch.profiler import profile, ProfilerActivity
from stabilitylab.config import stress_8k
from stabilitylab.model import Encoder, masked_lm_loss_sum, vocab_size_for
from stabilitylab.train import make_optimizer
cfg = stress_8k(); T = cfg.data.context_len; vocab = vocab_size_for(cfg.data.n_genes); dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
tok = torch.randint(3, vocab, (1, T), generator=g).to(dev)
lab = torch.where(torch.rand(1, T, generator=g) < 0.15, tok.cpu(), -100).to(dev)
lens = torch.full((1,), T, dtype=torch.long, device=dev)
arms = {}
for backend in ("softmax", "sigmoid-triton"):
    torch.manual_seed(0)
    m = Encoder(cfg.model, vocab, T, backend).to(dev); opt = make_optimizer(cfg, m)
    arms[backend] = (m, opt)
def step(m, opt, with_opt):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = m(tok, lens)
    loss = masked_lm_loss_sum(logits, lab) / (lab != -100).sum()
    loss.backward()
    if with_opt:
        opt.found_inf = None; opt.step(); opt.zero_grad(set_to_none=True)
    else:
        m.zero_grad(set_to_none=True)
def timed(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); return time.perf_counter() - t0
for b, (m, opt) in arms.items():
    for _ in range(3): step(m, opt, True)
res = {(b, k): [] for b in arms for k in ("fwdbwd", "full")}
for _ in range(12):
    for b, (m, opt) in arms.items():
        res[(b, "fwdbwd")].append(timed(lambda: step(m, opt, False)))
        res[(b, "full")].append(timed(lambda: step(m, opt, True)))
for k, v in res.items():
    print(f"{k[0]:15s} {k[1]:7s} wall median {statistics.median(v)*1e3:7.2f} ms  min {min(v)*1e3:7.2f}")
for b, (m, opt) in arms.items():
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = timed(lambda: step(m, opt, True))
    ev = prof.key_averages()
    dev_total = sum(e.self_device_time_total for e in ev) / 1e3
    print(f"== {b}: wall {t*1e3:.2f} ms, summed kernel time {dev_total:.2f} ms")
    print(ev.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
