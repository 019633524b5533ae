"""The paged decode-attention kernel (kernels/decode_attention.py) against float64.

Criterion as in tests/test_kernels.py: err(kernel, ref64) <= 2 * err(torch at the kernel's
dtype, ref64) + atol (max abs errors), for the output and for the score side output. Every pool
slot that holds no live entry (free pages, slots past a row's count) and its key bias is NaN, so
a kernel that reads one fails. On CPU the kernels run in Triton's interpreter on tiny shapes, in
float32, float16 and bfloat16 too (no ``tl.dot`` here, whose bf16 the interpreter gets wrong);
long rows and head dims 64 / 128 on the GPU (marked gpu).
"""

from __future__ import annotations

import random

import pytest
import torch

from stabilitylab.kernels.decode_attention import (
    MAX_SPLITS,
    add_scores_reference,
    decode_attention,
    decode_attention_reference,
    split_plan,
)

ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


@pytest.fixture
def gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def paged_inputs(counts, H, D, page, M, dtype, device, gen, gated):
    """A pool of NaN with each row's ``count`` live entries written at pages drawn at random
    (rows share no page; spare pages stay NaN), the key bias NaN outside live slots too."""
    B = len(counts) // H
    n_pages = B * H * M + 5
    k = torch.full((n_pages, page, D), float("nan"), dtype=torch.float64)
    v, kb = k.clone(), torch.full((n_pages, page), float("nan"), dtype=torch.float64)
    table = torch.randperm(n_pages, generator=gen)[: B * H * M].view(B, H, M).int()
    count = torch.tensor(counts, dtype=torch.int32).view(B, H)
    for b in range(B):
        for h in range(H):
            n = int(count[b, h])
            pages, offs = table[b, h].long()[torch.arange(n) // page], torch.arange(n) % page
            k[pages, offs] = torch.randn(n, D, generator=gen, dtype=torch.float64)
            v[pages, offs] = torch.randn(n, D, generator=gen, dtype=torch.float64)
            g = torch.rand(n, generator=gen, dtype=torch.float64) * 0.98 + 0.01
            kb[pages, offs] = torch.log(g + 1e-8)
    q = torch.randn(B, H, D, generator=gen, dtype=torch.float64) * 2
    bias = -torch.log(torch.randint(4, 64, (B,), generator=gen).float())
    kb = kb.float() if gated else None
    to = dict(device=device)
    return (q.to(dtype).to(**to), k.to(dtype).to(**to), v.to(dtype).to(**to), table.to(**to),
            count.to(**to), None if kb is None else kb.to(**to), bias.to(**to))  # fmt: skip


def run_and_check(kind, dtype, device, gen, counts, H=2, D=16, page=4, M=5, gated=True,
                  scores=True, num_splits=None):  # fmt: skip
    q, k, v, table, count, kb, bias = paged_inputs(counts, H, D, page, M, dtype, device, gen, gated)
    sb = bias if kind == "sigmoid" else None
    ref = {}
    for name, dt in (("64", torch.float64), ("t", dtype)):
        out_r, w_r, slot_r = decode_attention_reference(
            q.to(dt), k.to(dt), v.to(dt), table, count, kind=kind, sigmoid_bias_B=sb,
            key_bias_PS=kb,
        )  # fmt: skip
        score_r = torch.zeros(k.shape[:2], dtype=torch.float64, device=device)
        add_scores_reference(score_r, w_r, slot_r, count)
        ref[name] = (out_r, score_r)
    score = torch.zeros(k.shape[:2], dtype=torch.float64, device=device) if scores else None
    out = decode_attention(q, k, v, table, count, kind=kind, sigmoid_bias=sb, key_bias_PS=kb,
                           score_PS=score, num_splits=num_splits)  # fmt: skip
    assert out.dtype == dtype and not out.isnan().any()
    assert _err(out, ref["64"][0]) <= 2 * _err(ref["t"][0], ref["64"][0]) + ATOL[dtype]
    if scores:
        assert _err(score, ref["64"][1]) <= 2 * _err(ref["t"][1], ref["64"][1]) + ATOL[dtype]
        # Only live entries' scores move: the NaN slots' scores stay exactly 0.
        assert (score[ref["64"][1] == 0] == 0).all()
    return out


CASES = {
    # every row the same count, below the capacity: padding slots past it in every row
    "padded": dict(counts=[13] * 6, gated=False, scores=False, num_splits=None),
    # counts from 0 to the full capacity, several splits per row, gate bias and scores
    "ragged": dict(counts=[0, 1, 7, 20, 16, 3], gated=True, scores=True, num_splits=3),
}


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_kernel_matches_float64_reference(monkeypatch, gen, kind, dtype, case):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_and_check(kind, dtype, "cpu", gen, **CASES[case])


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_one_split_and_many_splits_agree(monkeypatch, gen, kind):
    """The merge is exact maths: splitting a row changes only float32 rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    state = gen.get_state()
    one = run_and_check(kind, torch.float32, "cpu", gen, [20, 17], H=1, scores=False,
                        num_splits=1)  # fmt: skip
    gen.set_state(state)
    many = run_and_check(kind, torch.float32, "cpu", gen, [20, 17], H=1, scores=False,
                         num_splits=3)  # fmt: skip
    torch.testing.assert_close(one, many, rtol=0, atol=1e-6)


def test_split_plan_covers_the_rows_in_whole_chunks():
    for rows, slots, programs, want in [(6, 32768, 132, None), (192, 1024, 132, None),
                                        (1, 100, 132, None), (4, 512, 3, 3), (2, 9000, 132, 999)]:  # fmt: skip
        splits, chunk = split_plan(rows, slots, programs, want)
        assert 1 <= splits <= MAX_SPLITS and chunk % 128 == 0
        assert (splits - 1) * chunk < max(slots, 1) <= splits * chunk
    # B = 1, H = 6 on 132 SMs: 44 splits asked, chunks of 6 x 128 slots give 43.
    assert split_plan(6, 32768, 132) == (43, 768)
    assert split_plan(4, 512, 3, num_splits=3) == (2, 256)  # 4 granules of 128 in 2 chunks


@pytest.mark.interpreter
def test_bad_inputs_are_refused_by_name(monkeypatch, gen):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, table, count, kb, bias = paged_inputs([3, 2], 1, 16, 4, 2, torch.float32, "cpu",
                                                   gen, True)  # fmt: skip
    ok = dict(kind="sigmoid", sigmoid_bias=bias, key_bias_PS=kb)
    cases = [
        (dict(q_BHD=q[..., :12]), "head dim"),
        (dict(k_pages_PSD=k.half()), "k_pages_PSD has dtype"),
        (dict(block_table_BHM=table.long()), "block_table_BHM has dtype"),
        (dict(count_BH=count + 100), r"count_BH must lie in \[0, 8\]"),
        (dict(kind="relu"), "kind must be one of"),
        (dict(sigmoid_bias=None), "needs sigmoid_bias"),
        (dict(key_bias_PS=kb.double()), "key_bias_PS has dtype"),
        (dict(score_PS=torch.zeros(3)), "score_PS must have rank 2"),
        (dict(num_splits=0), "num_splits must be"),
    ]
    base = dict(q_BHD=q, k_pages_PSD=k, v_pages_PSD=v, block_table_BHM=table, count_BH=count)
    for over, match in cases:
        args = {**base, **ok, **over}
        pos = [args.pop(n) for n in ("q_BHD", "k_pages_PSD", "v_pages_PSD", "block_table_BHM",
                                     "count_BH")]  # fmt: skip
        with pytest.raises(ValueError, match=match):
            decode_attention(*pos, **args)


# ---- GPU: bf16, long rows, a captured graph ---------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_kernel_on_the_gpu(gen, kind, dtype):
    counts = [0, 1, 63, 64, 65, 1000, 4095, 4096] * 2
    run_and_check(kind, dtype, "cuda", gen, counts, H=4, D=64, page=16, M=256)
    run_and_check(kind, dtype, "cuda", gen, counts, H=4, D=128, page=16, M=256, gated=False,
                  scores=False)  # fmt: skip


@gpu
def test_a_captured_graph_replays_the_eager_call(gen):
    q, k, v, table, count, kb, bias = paged_inputs([100, 900, 4, 2000], 2, 64, 16, 128,
                                                   torch.bfloat16, "cuda", gen, True)  # fmt: skip
    out = torch.empty_like(q)
    kw = dict(kind="sigmoid", sigmoid_bias=bias, key_bias_PS=kb, out_BHD=out)
    eager = decode_attention(q, k, v, table, count, **kw).clone()  # warm-up: tuning, compiling
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, table, count, **kw)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
