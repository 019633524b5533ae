"""Triton softmax attention against float64, and the determinism of both Triton kernels.

Criterion as in tests/test_kernels.py: err(kernel, ref64) <= 2 * err(torch at the kernel's dtype,
ref64) + atol, 3x for gradients (q, k, v and the key bias), max abs errors; padded positions of
every input and of the incoming gradient are NaN, so a kernel that reads them fails. On CPU the
kernels run in Triton's interpreter in float32 and float16 (its bf16 tl.dot is wrong), on tiny
shapes; bf16 at T up to 2K on the GPU. Determinism: two identical calls give the same bits, for
softmax-triton and sigmoid-triton alike (neither uses atomics), and under
``torch.use_deterministic_algorithms`` each kernel launches one pinned config, untimed.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from stabilitylab.kernels import sigmoid_attention, softmax_attention
from stabilitylab.kernels.reference import (
    key_mask_BT,
    max_abs_logit_reference,
    softmax_attention_reference,
    visible_BTT,
)
from tests.test_kernels import ATOL, _err, _gate_bias, _generator, _inputs

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
sm = importlib.import_module("stabilitylab.kernels.softmax_attention")

CUDA = torch.cuda.is_available()


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _ref_grads(q, k, v, lengths, g, key_bias, causal):
    """Output and gradients (q, k, v, and the key bias of ``{name: tensor}``, if any) through the
    softmax reference at q's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *key_bias.values())]
    bias = {name: leaves[3] for name in key_bias}
    out = softmax_attention_reference(*leaves[:3], lengths, causal=causal, **bias)
    return out.detach(), torch.autograd.grad(out, leaves, g.to(out.dtype))


def _lse64(q, k, lengths, key_bias, causal):
    """log-sum-exp over visible keys per query row, float64, written apart from the kernel."""
    B, H, T, D = q.shape
    s = q.double() @ k.double().transpose(-1, -2) / D**0.5
    if key_bias:
        (kb,) = key_bias.values()
        s = s + (kb.double()[:, None, None, :] if kb.dim() == 2 else kb.double()[:, :, None, :])
    s = s.masked_fill(~visible_BTT(lengths, T, causal)[:, None], float("-inf"))
    return torch.logsumexp(s, dim=-1)


def check_against_reference(device, dtype, D, T, lengths, gen, causal=False, key_bias=None,
                            where=""):  # fmt: skip
    """Output, gradients, max|logit| and lse against float64, padded rows zero."""
    B, H = len(lengths), 2
    (q, k, v), (qn, kn, vn), lengths_B = _inputs(B, H, T, D, lengths, dtype, device, gen)
    valid = key_mask_BT(lengths_B, T)[:, None, :, None]
    g = torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)
    g_nan, g = g.masked_fill(~valid, float("nan")), g * valid
    kb, kb_nan = _gate_bias(key_bias, B, H, T, lengths_B, gen, device)
    kb64 = {name: t.double() for name, t in kb.items()}
    out64, grads64 = _ref_grads(q.double(), k.double(), v.double(), lengths_B, g, kb64, causal)
    out_t, grads_t = _ref_grads(q, k, v, lengths_B, g, kb, causal)
    leaves = [t.detach().requires_grad_() for t in (qn, kn, vn, *kb_nan.values())]
    out, max_BH, lse = softmax_attention(
        *leaves[:3], lengths_B, causal=causal, return_max_logit=True, return_lse=True,
        **{name: leaves[3] for name in kb_nan},
    )  # fmt: skip
    grads = torch.autograd.grad(out, leaves, g_nan)
    assert out.shape == q.shape and out.dtype == dtype, where
    assert _err(out, out64) <= 2 * _err(out_t, out64) + ATOL[dtype], where
    for name, a, t_, r in zip(["q", "k", "v", "key_bias"], grads, grads_t, grads64, strict=False):
        assert torch.isfinite(a).all(), f"d{name} not finite, {where}"
        assert _err(a, r) <= 3 * _err(t_, r) + ATOL[dtype], f"d{name}, {where}"
    lse64 = _lse64(q, k, lengths_B, kb, causal)
    for b, L in enumerate(lengths):
        assert (out[b, :, L:] == 0).all(), f"padded query rows must be zero, {where}"
        assert all((a[b, ..., L:, :] == 0).all() for a in grads[:3]), f"padded rows, {where}"
        if kb:
            assert (grads[3][b, ..., L:] == 0).all(), f"padded keys: zero bias gradient, {where}"
        assert (lse[b, :, L:] == 0).all(), where
        torch.testing.assert_close(lse[b, :, :L].double(), lse64[b, :, :L], rtol=1e-5,
                                   atol=1e-5 if dtype == torch.float32 else 2e-3, msg=where)  # fmt: skip
    max_ref = max_abs_logit_reference(q.double(), k.double(), lengths_B, causal=causal)
    torch.testing.assert_close(max_BH.double(), max_ref.double(), rtol=1e-4, atol=1e-5, msg=where)


# (T, lengths, causal, key bias kind, head dim) per dtype in the interpreter: odd lengths with
# padding, a length-1 sequence, lengths on a tile boundary short of T, an unpadded batch; causal
# and both kinds of key bias; head dim 128 once.
CPU_CASES = {
    torch.float16: [
        (37, [37, 19], False, None, 64),
        (37, [19, 37], True, "BT", 64),
        (21, [1, 21], True, None, 64),
        (37, [37, 37], False, "BHT", 64),
    ],
    torch.float32: [
        (37, [32, 16], False, "BT", 64),
        (37, [37, 19], True, "BHT", 64),
        (21, [21, 9], True, "BT", 128),
    ],
}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_matches_reference_in_the_interpreter(dtype, interpreter):
    gen = _generator("cpu")
    for T, lengths, causal, kind, D in CPU_CASES[dtype]:
        where = f"T={T} lengths={lengths} causal={causal} key_bias={kind} D={D}"
        check_against_reference("cpu", dtype, D, T, lengths, gen, causal, kind, where)


@pytest.mark.interpreter
def test_tma_loads_match_reference(interpreter, monkeypatch):
    """The descriptor loads (the op's from T = 4096), forced at a tiny T."""
    monkeypatch.setattr(sa, "TMA_MIN_T", 1)
    check_against_reference("cpu", torch.float16, 64, 37, [37, 19], _generator("cpu"), True, "BT")


@pytest.mark.interpreter
@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)], ids=["tall", "wide"])
def test_unequal_tiles_match_reference(blocks, interpreter, monkeypatch):
    """Query tiles taller than key tiles and the reverse (the GPU's configs have both): the causal
    splits, and the masked last key tile without causal masking."""
    monkeypatch.setattr(sa, "INTERPRETER_BLOCKS", {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]})
    gen = _generator("cpu")
    for causal in (True, False):
        check_against_reference("cpu", torch.float32, 64, 37, [37, 19], gen, causal, "BT")


@pytest.mark.interpreter
def test_extreme_logits_stay_finite_and_accurate(interpreter):
    """Scores far from 0 either way: large q.k (the online max must rescale) and a key bias of
    -1000 (lse near -1000: a padded key read as zeros would get P = exp(1000) if left unmasked)."""
    gen = _generator("cpu")
    B, H, T, D, lengths = 2, 1, 37, 64, [37, 19]
    (q, k, v), _, lengths_B = _inputs(B, H, T, D, lengths, torch.float32, "cpu", gen)
    kb = torch.full((B, T), -1000.0)
    g = torch.randn(B, H, T, D, generator=gen) * key_mask_BT(lengths_B, T)[:, None, :, None]
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q * 4, k * 4, v, kb)]
        out, _ = softmax_attention(*leaves[:3], lengths_B, causal=causal, key_bias_BT=leaves[3])
        grads = torch.autograd.grad(out, leaves, g)
        out64, grads64 = _ref_grads(
            *(t.double() for t in (q * 4, k * 4, v)), lengths_B, g, {"key_bias_BT": kb}, causal
        )
        assert _err(out, out64) < 1e-4, causal
        for a, r in zip(grads, grads64, strict=True):
            assert torch.isfinite(a).all() and _err(a, r) < 1e-3 * max(1.0, r.abs().max()), causal


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["softmax", "sigmoid"])
def test_two_calls_give_the_same_bits(name, interpreter):
    """Forward and backward twice on the same inputs: the same bits, the key bias's gradient
    included (reduced in a fixed order per key tile, summed over heads by torch): no atomics in
    either kernel. The GPU twin: test_bf16_repeats_bit_for_bit_on_the_gpu."""
    _assert_repeats("cpu", torch.float16, 37, [37, 19], name)


def _assert_repeats(device, dtype, T, lengths, name):
    fn = softmax_attention if name == "softmax" else sigmoid_attention
    gen = _generator(device)
    _, (q, k, v), lengths_B = _inputs(2, 2, T, 64, lengths, dtype, device, gen)
    _, kb = _gate_bias("BT", 2, 2, T, lengths_B, gen, device)
    g = torch.randn(q.shape, generator=gen, device=device).to(dtype)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, kb["key_bias_BT"])]
        out, max_BH = fn(*leaves[:3], lengths_B, causal=True, key_bias_BT=leaves[3],
                         return_max_logit=True)  # fmt: skip
        runs.append((out, max_BH, *torch.autograd.grad(out, leaves, g)))
    for label, a, b in zip(["out", "max", "dq", "dk", "dv", "dkb"], *runs, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name}: {label}"


@pytest.mark.interpreter
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "causal-key_bias"])
def test_custom_op_path_equals_the_eager_function(gated, interpreter):
    """torch.compile goes through the custom ops, eager through an autograd.Function: the same
    kernels, so the same bits (output, lse, max|logit|, gradients)."""
    gen = _generator("cpu")
    T = 37
    _, (qn, kn, vn), lengths_B = _inputs(2, 2, T, 64, [37, 19], torch.float16, "cpu", gen)
    _, kb = _gate_bias("BT" if gated else None, 2, 2, T, lengths_B, gen, "cpu")
    g = torch.randn(qn.shape, generator=gen).to(qn.dtype)
    results = []
    for fn in (sm._fwd_op, sm._EagerSoftmaxAttention.apply):
        leaves = [t.detach().clone().requires_grad_() for t in (qn, kn, vn, *kb.values())]
        tail = (True, leaves[3][:, None].expand(2, 2, T)) if gated else ()
        out, lse, max_BH = fn(*leaves[:3], lengths_B, 0.125, True, *tail)
        results.append((out, lse, max_BH, *torch.autograd.grad(out, leaves, g)))
    assert len(results[0]) == (7 if gated else 6)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.interpreter
def test_torch_compile_fullgraph_no_break(interpreter):
    """The model's train.compile path: no graph break around the op, and eager's values."""
    torch._dynamo.reset()
    gen = _generator("cpu")
    T, lengths = 37, [37, 19]
    (q, k, v), _, lengths_B = _inputs(2, 2, T, 64, lengths, torch.float32, "cpu", gen)
    kb, _ = _gate_bias("BT", 2, 2, T, lengths_B, gen, "cpu")

    def step(q, k, v, lengths_B, key_bias_BT):
        out, _ = softmax_attention(q, k, v, lengths_B, causal=True, key_bias_BT=key_bias_BT)
        return out.transpose(1, 2).reshape(2, T, -1) * 2.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, step):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, kb["key_bias_BT"])]
        out = fn(*leaves[:3], lengths_B, leaves[3])
        results.append((out, *torch.autograd.grad(out.sum(), leaves)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_deterministic_mode_launches_one_pinned_config_untimed(monkeypatch):
    """Autotuning picks by timing, which varies between processes, and configs of other tiles sum
    in another order: under torch.use_deterministic_algorithms each kernel gets a launcher of its
    own holding one config (the smallest tile), so the autotuner times nothing."""
    made = []

    class FakeTuned:
        def __init__(self, kernel, configs, key_names):
            self.configs = configs
            made.append(self)

        def launch(self, grid, key, *args, **kwargs):
            pass

    monkeypatch.setattr(sa, "Tuned", FakeTuned)
    monkeypatch.setattr(sa, "_TUNED", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    levers = dict(HEAD_DIM=64, TMA=False, CAUSAL=False, HAS_KEY_BIAS=False)
    try:
        for deterministic in (False, True, True):
            torch.use_deterministic_algorithms(deterministic)
            sa._launch(sm._softmax_bwd_dkdv_kernel, "dkdv", q, (1,), (q, 64), levers)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(made) == 2  # the pinned launcher apart from the autotuned one, made once
    listed = made[0].configs
    assert len(listed) > 1
    (pinned,) = made[1].configs
    tile = lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]
    assert pinned is sa.pinned_config(listed) and tile(pinned) == min(map(tile, listed))


_BAD_INPUTS = {
    "head_dim": (lambda q, L: ((q[..., :32],) * 3 + (L,), {}), "head dim"),
    "dtype": (lambda q, L: ((q.double(),) * 3 + (L,), {}), "unsupported dtype"),
    "lengths": (lambda q, L: ((q, q, q, L + 1), {}), r"\[1, T=8\]"),
    "causal": (lambda q, L: ((q, q, q, L), {"causal": 1}), "causal must be a bool"),
    "scale": (lambda q, L: ((q, q, q, L), {"scale": 0.0}), "scale must be a positive"),
    "return_lse": (lambda q, L: ((q, q, q, L), {"return_lse": "yes"}), "return_lse must be"),
    "key_bias": (
        lambda q, L: (
            (q, q, q, L),
            {"key_bias_BT": torch.zeros(2, 8), "key_bias_BHT": torch.zeros(2, 2, 8)},
        ),
        "key_bias_BT or key_bias_BHT",
    ),  # fmt: skip
    "key_bias_shape": (
        lambda q, L: ((q, q, q, L), {"key_bias_BT": torch.zeros(2, 7)}),
        r"key_bias_BT must have shape \(2, 8\)",
    ),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", sorted(_BAD_INPUTS))
def test_bad_arguments_are_refused_by_name(bad, interpreter):
    make, msg = _BAD_INPUTS[bad]
    args, kwargs = make(torch.randn(2, 2, 8, 64), torch.tensor([8, 3]))
    with pytest.raises(ValueError, match=msg):
        softmax_attention(*args, **kwargs)


def test_cpu_without_interpreter_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 8, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        softmax_attention(q, q, q, torch.tensor([8]))


# The interpreter runs kernels as Python: one it accepts may still fail in Triton's compiler (it
# did: a module global read inside a jit function). This compiles the causal + key-bias variant of
# every kernel, with TMA loads at head dim 128, to sm_90a PTX without a GPU, in a process that
# imported triton without the interpreter (experiments/bench/ptx_offline.py's compiler entry).
COMPILE_SOFTMAX = """
import importlib, sys, torch
sys.path.insert(0, sys.argv[1])
import ptx_offline as p
from triton.compiler.compiler import make_backend
sa, sm, ts = (importlib.import_module(f"stabilitylab.kernels.{m}")
              for m in ("sigmoid_attention", "softmax_attention", "triton_support"))
sa.capability = ts.capability = lambda device: (9, 0)
launches = []
sm._launch = lambda kernel, kind, q, grid, args, kwargs, dense=False: launches.append(
    (kernel, sa._configs(kind, (9, 0))[0], args, kwargs))
def delta(out, do, lengths):
    B, H, T, D = out.shape
    d = torch.zeros(B, H, T)
    args = (out, do, d, lengths, *out.stride()[:3], *do.stride()[:3], H, T)
    launches.append((sm._softmax_bwd_delta_kernel, None, args, {"HEAD_DIM": D, "BLOCK_M": 64}))
    return d
sm._delta = delta
T, D = 4096, 128
q, k, v, do = torch.zeros(4, 2, 2, T, D, dtype=torch.bfloat16).unbind(0)
lengths, kb = torch.tensor([T, 3001], dtype=torch.int32), torch.zeros(2, 2, T)
sm.forward_auto(q, k, v, lengths, 0.1, True, True, kb)
sm.backward_auto(do, q, k, v, q, torch.zeros(2, 2, T), lengths, 0.1, True, kb)
backend = make_backend(p.TARGET)
for kernel, config, args, kwargs in launches:
    warps, stages = (config.num_warps, config.num_stages) if config else (4, 2)
    kw = {**kwargs, **(config.kwargs if config else {}), "num_warps": warps, "num_stages": stages}
    text = p.ptx(kernel, args, {**kw, "debug": False}, backend)
    name = kernel.fn.__name__
    print(name, kwargs.get("TMA", True), f".entry {name}(" in text, "wgmma.mma_async" in text)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    bench = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_SOFTMAX, str(bench)], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    assert compiled == {
        "_softmax_fwd_kernel": "True True True",  # TMA, an entry point, wgmma
        "_softmax_bwd_delta_kernel": "True True False",  # no dot product in it
        "_softmax_bwd_dq_kernel": "True True True",
        "_softmax_bwd_dkdv_kernel": "True True True",
    }


# ---- GPU: bf16 at longer T, production configs -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "deterministic, D",
    [
        pytest.param(False, 64, marks=pytest.mark.exhaustive, id="autotuned-64"),
        pytest.param(False, 128, id="autotuned-128"),
        pytest.param(True, 64, id="pinned-64"),
        pytest.param(True, 128, id="pinned-128"),
    ],
)
def test_bf16_matches_reference_on_the_gpu(D, deterministic, monkeypatch, request):
    """bf16 up to T = 2K, padded and not, causal and not, both key bias kinds; autotuned configs
    and, under torch.use_deterministic_algorithms, the pinned ones (they must fit every head dim,
    and cost one compile each). Autotuning every config at four new lengths is the slow part: at
    head dim 64 it is exhaustive (the pinned case and the sigmoid kernel's tests run that dim).
    """
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the references' matmuls
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(False))
    torch.use_deterministic_algorithms(deterministic)
    gen = _generator("cuda")
    cases = [(523, [523, 300], False, None), (2048, [2048, 1531], True, "BT"),
             (2048, [2048, 2048], False, "BHT"), (700, [1, 700], True, None)]  # fmt: skip
    for T, lengths, causal, kind in cases:
        where = f"T={T} lengths={lengths} causal={causal} key_bias={kind}"
        check_against_reference("cuda", torch.bfloat16, D, T, lengths, gen, causal, kind, where)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["softmax", "sigmoid"])
def test_bf16_repeats_bit_for_bit_on_the_gpu(name, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _assert_repeats("cuda", torch.bfloat16, 2048, [2048, 1531], name)
