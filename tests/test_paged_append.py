"""The fused decode-step write (kernels/paged_append.py) against its reference, PagedKV's
``ensure_page``, ``write_new`` and ``commit``: every buffer of the cache equal bit for bit after
the step (the trash page aside, which both fill with whatever rows that must not write send
there). Caches are put in random states: rows with full pages (they need one), rows with room,
inactive rows, rows at their table's end, a free list too short for every row (overflow).
Interpreter on CPU; compiled on CUDA (marked gpu)."""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from stabilitylab.inference.paged import STATE, PagedKV

CUDA = torch.cuda.is_available()
BUFFERS = ("k_PSD", "v_PSD", "pos_PS", "kb_PS", "score_PS", *STATE)


@pytest.fixture
def gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def random_cache(gen, B, H, D, P, M, n_pages, dtype, device, gated, scores) -> PagedKV:
    """A cache after a prefill whose kept counts are drawn so that some rows end on a page
    boundary (the next write needs a page) and some at their table's last slot."""
    cache = PagedKV.allocate(B, H, D, max_entries=M * P, page_size=P, dtype=dtype, device=device,
                             n_pages=n_pages, key_bias=gated, scores=scores)  # fmt: skip
    T = M * P
    choices = torch.tensor([0, P, 2 * P, P - 1, 1, T, T - 1])
    count_BH = choices[torch.randint(0, len(choices), (B, H), generator=gen)]
    while int(((count_BH + P - 1) // P).sum()) > n_pages:  # the prefill itself must fit
        count_BH = count_BH // 2
    keep_BHT = torch.arange(T) < count_BH[..., None]
    k = torch.randn(B, H, T, D, generator=gen).to(dtype)
    kb = torch.log(torch.rand(B, H, T, generator=gen) + 1e-8) if gated else None
    score = torch.rand(B, H, T, generator=gen, dtype=torch.float64) if scores else None
    cache.write_prefill(k.to(device), k.flip(-1).to(device), None if kb is None else kb.to(device),
                        keep_BHT.to(device), None if score is None else score.to(device))  # fmt: skip
    return cache


def step_inputs(gen, B, H, D, dtype, device, gated):
    k = torch.randn(B, H, 3, D, generator=gen).to(dtype)[:, :, 1]  # as the engine's k_BHTD[:, :, 0]
    v = torch.randn(B, 2 * H, D, generator=gen).to(dtype)[:, ::2]  # rows strided, D unit
    kb = torch.log(torch.rand(B, H, 1, generator=gen) + 1e-8)[..., 0] if gated else None
    pos = torch.randint(0, 1000, (B,), generator=gen)
    active_BH = (torch.rand(B, generator=gen) < 0.75)[:, None].expand(B, H)  # as the engine's
    return [t if t is None else t.to(device) for t in (k, v, kb, pos, active_BH)]


def clone(cache: PagedKV) -> PagedKV:
    return PagedKV(**{f: None if getattr(cache, f) is None else getattr(cache, f).clone()
                      for f in BUFFERS})  # fmt: skip


def assert_same(a: PagedKV, b: PagedKV) -> None:
    keep = a.trash_slot  # slots below the trash page
    for name in BUFFERS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None
            continue
        if name in ("k_PSD", "v_PSD", "pos_PS", "kb_PS", "score_PS"):
            x, y = x.flatten(0, 1)[:keep], y.flatten(0, 1)[:keep]
        same_bits = torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        assert same_bits, name  # bits: the pool's never-written slots may hold NaN


def run_case(gen, device, dtype, gated, scores, short_pool):
    B, H, D, P, M = 3, 2, 16, 4, 3
    n_pages = 4 if short_pool else B * H * M
    cache = random_cache(gen, B, H, D, P, M, n_pages, dtype, device, gated, scores)
    fused = clone(cache)
    for _ in range(3):  # a few steps: pages handed out, rows reaching their table's end
        k, v, kb, pos, active_BH = step_inputs(gen, B, H, D, dtype, device, gated)
        cache.append(k, v, kb, pos, active_BH, fused=False)
        fused.append(k, v, kb, pos, active_BH, fused=True)
        assert_same(cache, fused)
    return cache


@pytest.mark.interpreter
@pytest.mark.parametrize("gated,scores", [(True, False), (False, True), (True, True)])
def test_the_fused_step_write_equals_the_three_reference_methods(gen, gated, scores):
    for dtype in (torch.float32, torch.bfloat16):
        run_case(gen, "cpu", dtype, gated, scores, short_pool=False)


@pytest.mark.interpreter
def test_the_pop_order_carries_across_blocks_of_rows(gen, monkeypatch):
    """Rows in blocks of 4 (6 rows): the rank of a row that needs a page counts the rows of the
    blocks before it."""
    import stabilitylab.kernels.paged_append as module

    monkeypatch.setattr(module, "BLOCK_R", 4)
    for _ in range(2):
        run_case(gen, "cpu", torch.float32, True, True, short_pool=False)
        run_case(gen, "cpu", torch.float32, True, False, short_pool=True)


@pytest.mark.interpreter
def test_a_free_list_too_short_overflows_alike(gen):
    overflowed = [bool(run_case(gen, "cpu", torch.float32, True, False, True).overflow)
                  for _ in range(4)]  # fmt: skip
    assert any(overflowed)  # the case reaches the overflow it is about


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_fused_step_write_equals_the_reference_on_the_gpu(gen):
    for gated, scores in ((True, False), (False, True)):
        run_case(gen, "cuda", torch.bfloat16, gated, scores, short_pool=False)
        run_case(gen, "cuda", torch.bfloat16, gated, scores, short_pool=True)


def test_the_fused_write_refuses_what_it_cannot_take():
    cache = PagedKV.allocate(1, 2, 16, max_entries=8, page_size=4, dtype=torch.float32,
                             device="cpu", key_bias=True)  # fmt: skip
    k = torch.zeros(1, 2, 16)
    active = torch.ones(1, 2, dtype=torch.bool)
    pos = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="kb_BH must be given"):
        cache.append(k, k, None, pos, active, fused=True)
    with pytest.raises(ValueError, match="k_BHD must be"):
        cache.append(k.double(), k, torch.zeros(1, 2), pos, active, fused=True)
    with pytest.raises(ValueError, match="active_BH must be"):
        cache.append(k, k, torch.zeros(1, 2), pos, active.int(), fused=True)
    with pytest.raises(ValueError, match="pos_B must be"):
        cache.append(k, k, torch.zeros(1, 2), pos.float(), active, fused=True)


COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
import ptx_offline as p
import torch
from triton.compiler.compiler import make_backend
import stabilitylab.kernels.paged_append as pa
from stabilitylab.inference.paged import PagedKV

launches = []


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))


pa.compiled = Recorder
B, H, D = 4, 6, 64
for gated, scores in ((True, False), (False, True)):
    cache = PagedKV.allocate(B, H, D, max_entries=64, page_size=16, dtype=torch.bfloat16,
                             device="cpu", key_bias=gated, scores=scores)
    k = torch.zeros(B, H, D, dtype=torch.bfloat16)
    active = torch.ones(B, 1, dtype=torch.bool).expand(B, H)
    pa.paged_append(cache, k, k, torch.zeros(B, H) if gated else None,
                    torch.zeros(B, dtype=torch.long), active)
backend = make_backend(p.TARGET)
for kernel, args, kwargs in launches:
    text = p.ptx(kernel, args, {**kwargs, "num_warps": 4, "num_stages": 1, "debug": False}, backend)
    print(kwargs["HAS_KB"], kwargs["HAS_SCORE"], ".entry _append_kernel(" in text)
"""


def test_the_fused_write_compiles_for_sm90_without_a_gpu():
    """The kernel as the engine launches it (bf16, key bias or scores) through Triton's compiler
    to sm_90a PTX (experiments/bench/ptx_offline.py), in a process without the interpreter."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE, str(bench)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "True", "False", "True", "True"]
