"""Triton sigmoid attention and max|logit| against float64 references.

Criterion (the field's): err(kernel, ref64) <= 2 * err(torch at the kernel's dtype, ref64) + atol,
3x for gradients; max abs errors. CPU runs use Triton's interpreter (TRITON_INTERPRET=1 set per test,
read by the launchers at call time, so import order within one pytest process does not matter);
the same tests run the compiled kernels with the production autotune configs on CUDA. bf16 runs
only on CUDA: the interpreter's bf16 tl.dot is wrong (triton 3.6 and 3.9, measured 2026-11-29).

Padded positions of every kernel input (and of the incoming gradient) are filled with NaN: the
kernels must never read them. Inputs are drawn fresh per test; the seed is printed for replay.
Long sweeps (every launch config; the load paths at every dtype) are marked ``exhaustive`` and run
only with ``--exhaustive`` (tests/conftest.py), so that ``pytest -m gpu`` stays short.
"""

from __future__ import annotations

import importlib
import math
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from stabilitylab.kernels import max_abs_logit, sigmoid_attention
from stabilitylab.kernels.reference import (
    key_mask_BT,
    max_abs_logit_reference,
    sigmoid_attention_reference,
)

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")  # the module, not the op

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
# (T, lengths) per device: tiny in the interpreter, several production tiles on the GPU.
# "whole_tiles": lengths that end on a tile boundary short of T, so the last key tile is full and
# the look-ahead tile past it lies wholly in the NaN padding. "full": no padding, T not a multiple
# of the tile: the op takes the dense kernels there (16-bit, head dim 128), which read past T as
# zeros.
SHAPES = {
    "cpu": {
        "odd": (37, [37, 19]),
        "len1": (21, [1, 21]),
        "all_but_one": (33, [1, 1]),
        "whole_tiles": (37, [32, 16]),
        "full": (37, [37, 37]),
    },
    "cuda": {
        "odd": (523, [523, 300]),
        "len1": (257, [1, 257]),
        "all_but_one": (700, [1, 1]),
        "whole_tiles": (523, [512, 256]),
        "full": (523, [523, 523]),
    },
}


GPU_DEFAULT = {
    (torch.bfloat16, "ptr", 64), (torch.bfloat16, "ptr", 128), (torch.bfloat16, "tma", 128),
    (torch.float16, "ptr", 128), (torch.float32, "ptr", 64),
}  # fmt: skip
"""The GPU cases of the reference test in ``pytest -m gpu``: each dtype once, bf16 (the training
dtype) at both head dims with pointer loads and at head dim 128 (its TMA lever) with TMA loads.
Every GPU case compiles and autotunes its kernels at five new lengths (13-27 s each on an H100);
the other three are exhaustive."""


def _cases() -> list:
    """(device, dtype, loads, D) for the reference test. ``loads``: pointer loads (the op below
    T = 4096, as at these T) or TMA loads (the op from T = 4096; forced here by lowering
    ``TMA_MIN_T``). Each device's main 16-bit dtype (bf16; fp16 in the interpreter) runs both
    load paths, the other dtypes pointer loads; their TMA runs are exhaustive, and on the GPU the
    cases outside ``GPU_DEFAULT``."""
    cases = []
    for device, main in (("cpu", torch.float16), ("cuda", torch.bfloat16)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if device == "cpu" and dtype == torch.bfloat16:
                continue  # the interpreter's bf16 tl.dot is wrong
            for loads in ("ptr", "tma"):
                for D in (64, 128):
                    marks = list(gpu) if device == "cuda" else []
                    sweep = device == "cuda" and (dtype, loads, D) not in GPU_DEFAULT
                    if (loads == "tma" and dtype != main) or sweep:
                        marks.append(pytest.mark.exhaustive)
                    name = f"{device}-{str(dtype).removeprefix('torch.')}-{loads}-{D}"
                    cases.append(pytest.param(device, dtype, loads, D, marks=marks, id=name))
    return cases


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def _use_loads(loads: str, monkeypatch) -> None:
    """``tma``: the op takes TMA loads at any T where the strides allow (``use_tma``)."""
    if loads == "tma":
        monkeypatch.setattr(sa, "TMA_MIN_T", 1)


def _generator(device: str) -> torch.Generator:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator(device).manual_seed(seed)


def _inputs(B, H, T, D, lengths, dtype, device, gen):
    """Model layout: q/k/v are permuted views of one (B, T, 3, H, D) tensor, padding = NaN."""
    lengths_B = torch.tensor(lengths, device=device)
    qkv = torch.randn(B, T, 3, H, D, generator=gen, device=device, dtype=torch.float32)
    valid = key_mask_BT(lengths_B, T)[:, :, None, None, None]
    clean = (qkv * valid).to(dtype)
    dirty = clean.masked_fill(~valid, float("nan"))
    views = lambda t: t.permute(2, 0, 3, 1, 4).unbind(0)
    return views(clean), views(dirty), lengths_B


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _ref_grads(q, k, v, lengths, g, key_bias=None, **kw):
    """Output and gradients (of q, k, v, and of ``key_bias``: ``{"key_bias_BT": t}`` or
    ``{"key_bias_BHT": t}``) through the reference, at q's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    bias = {}
    if key_bias:
        ((name, kb),) = key_bias.items()
        bias = {name: kb.detach().clone().requires_grad_()}  # the reference adds it at q's dtype
        leaves.append(bias[name])
    out = sigmoid_attention_reference(*leaves[:3], lengths, **kw, **bias)
    return out.detach(), torch.autograd.grad(out, leaves, g.to(out.dtype))


def _gate_bias(kind, B, H, T, lengths_B, gen, device):
    """``({key_bias_<kind>: clean}, {key_bias_<kind>: NaN at padded keys})``: a gate's
    log(g + 1e-8) with g spread over (0, 1), about -18 to 0; ``({}, {})`` for kind None."""
    if kind is None:
        return {}, {}
    shape = (B, T) if kind == "BT" else (B, H, T)
    gate = torch.rand(shape, generator=gen, device=device) ** 3
    valid = key_mask_BT(lengths_B, T) if kind == "BT" else key_mask_BT(lengths_B, T)[:, None]
    clean = torch.log(gate + 1e-8) * valid
    name = f"key_bias_{kind}"
    return {name: clean}, {name: clean.masked_fill(~valid, float("nan"))}


@pytest.mark.parametrize("device, dtype, loads, D", _cases(), indirect=["device"])
def test_matches_reference(device, dtype, loads, D, monkeypatch):
    """Output, gradients and fused max|logit| for every length case (padded, length 1, all but
    one padded, whole tiles, unpadded: the dense kernels), in one test so that parallel GPU
    workers do not compile the same kernels."""
    _use_loads(loads, monkeypatch)
    gen = _generator(device)
    # The exact-sigmoid path is compiled separately on CUDA; one 16-bit dtype covers it (in the
    # interpreter every run is exact).
    exact_too = device == "cuda" and dtype == torch.bfloat16 and loads == "ptr"
    for case, (T, lengths) in SHAPES[device].items():
        for exact in [False, True] if exact_too else [False]:
            where = f"{case} exact={exact}"
            _check_against_reference(device, dtype, D, T, lengths, exact, gen, where)


def _check_against_reference(
    device, dtype, D, T, lengths, exact, gen, where, causal=False, key_bias=None
):  # fmt: skip
    """The three-way check of output, gradients (and the key bias's), max|logit|, padded rows."""
    B, H = len(lengths), 2
    (q, k, v), (qn, kn, vn), lengths_B = _inputs(B, H, T, D, lengths, dtype, device, gen)
    valid = key_mask_BT(lengths_B, T)[:, None, :, None]
    g = torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)
    g_nan = g.masked_fill(~valid, float("nan"))
    g = g * valid
    kb, kb_nan = _gate_bias(key_bias, B, H, T, lengths_B, gen, device)
    kb64 = {name: t.double() for name, t in kb.items()}

    out64, grads64 = _ref_grads(
        q.double(), k.double(), v.double(), lengths_B, g, kb64, causal=causal
    )
    out_t, grads_t = _ref_grads(q, k, v, lengths_B, g, kb, causal=causal)
    leaves = [t.detach().requires_grad_() for t in (qn, kn, vn, *kb_nan.values())]
    out, max_BH = sigmoid_attention(
        *leaves[:3], lengths_B, exact=exact, return_max_logit=True, causal=causal,
        **{name: leaves[3] for name in kb_nan},
    )  # fmt: skip
    grads = torch.autograd.grad(out, leaves, g_nan)

    assert out.shape == q.shape and out.dtype == dtype, where
    assert _err(out, out64) <= 2 * _err(out_t, out64) + ATOL[dtype], where
    names = ["q", "k", "v", "key_bias"][: len(leaves)]
    for name, leaf, a, t_, r in zip(names, leaves, grads, grads_t, grads64, strict=True):
        assert a.dtype == leaf.dtype, f"d{name} dtype, {where}"
        assert torch.isfinite(a).all(), f"d{name} not finite, {where}"
        assert _err(a, r) <= 3 * _err(t_, r) + ATOL[dtype], f"d{name}, {where}"
    for b, L in enumerate(lengths):
        assert (out[b, :, L:] == 0).all(), f"padded query rows must be zero, {where}"
        for a in grads[:3]:
            assert (a[b, :, L:] == 0).all(), f"padded rows must get zero gradient, {where}"
        if kb:
            assert (grads[3][b, ..., L:] == 0).all(), f"padded keys: zero bias gradient, {where}"
    max_ref = max_abs_logit_reference(q.double(), k.double(), lengths_B, causal=causal)
    assert max_BH.dtype == torch.float32 and not max_BH.requires_grad, where
    torch.testing.assert_close(max_BH.double(), max_ref.double(), rtol=1e-4, atol=1e-5, msg=where)


@pytest.mark.exhaustive
@pytest.mark.parametrize("D", [64, 128])
def test_every_launch_config_matches_reference(device, D, monkeypatch):
    """Autotuning runs every production config but checks only the winner's output: here each
    config is forced in turn, through both load paths and the dense kernels. On the GPU the i-th
    config of every kernel's list (``_configs``); in the interpreter, which ignores warps and
    stages, every tile shape of the Hopper lists."""
    gen = _generator(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    kinds = ("fwd", "dq", "dkdv")
    if device == "cuda":
        configs, cap = sa._configs, sa.capability(torch.device("cuda"))
        n = max(len(configs(kind, cap)) for kind in kinds)

        def force(i):
            def one(kind, cap, fp32=False, dense=False):
                listed = configs(kind, cap, fp32, dense)
                return (listed[min(i, len(listed) - 1)],)

            monkeypatch.setattr(sa, "_configs", one)
            monkeypatch.setattr(sa, "_TUNED", {})  # a fresh autotuner per forced config

        steps = [lambda i=i: force(i) for i in range(n)]
    else:
        tiles = sorted({(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])
                        for kind in kinds for c in sa._configs(kind, (9, 0))})  # fmt: skip
        steps = [
            lambda m=m, n=n: monkeypatch.setattr(
                sa, "INTERPRETER_BLOCKS", {"BLOCK_M": m, "BLOCK_N": n}
            )
            for m, n in tiles
        ]
    production_min_t = sa.TMA_MIN_T
    for i, step in enumerate(steps):
        step()
        for loads in ("ptr", "tma"):
            monkeypatch.setattr(sa, "TMA_MIN_T", 1 if loads == "tma" else production_min_t)
            for case, (T, lengths) in SHAPES[device].items():
                where = f"config {i}, {loads}, {case}"
                _check_against_reference(device, dtype, D, T, lengths, False, gen, where)
                where += ", causal, key_bias_BT"
                _check_against_reference(
                    device, dtype, D, T, lengths, False, gen, where, causal=True, key_bias="BT"
                )


# (causal, key bias) combinations. The GPU runs all of them; the interpreter, which is slow, the
# three that cover causal alone, a per-head bias alone, and both with a shared bias.
GATED = {
    "cuda": [(True, None), (False, "BT"), (False, "BHT"), (True, "BT"), (True, "BHT")],
    "cpu": [(True, None), (False, "BHT"), (True, "BT")],
}


GATED_GPU_DEFAULT = {(torch.bfloat16, "ptr", 64), (torch.bfloat16, "tma", 128)}
"""The GPU cases of the causal / key-bias test in ``pytest -m gpu``: bf16 once per load path and
head dim (``pytest -m gpu`` ran past 300 s on an H200 with fp16 and fp32 in it, and 101 tests
took 270 s on an H100 with all four bf16 cases)."""


def _gated_cases() -> list:
    """(device, dtype, loads, D) for the causal / key-bias test: each device's main 16-bit dtype
    on both load paths at both head dims; on the GPU also fp16 and fp32 (pointer loads), and the
    cases outside ``GATED_GPU_DEFAULT``, exhaustive."""
    cases = [pytest.param("cpu", torch.float16, loads, D, id=f"cpu-float16-{loads}-{D}")
             for loads in ("ptr", "tma") for D in (64, 128)]  # fmt: skip
    for dtype, loads in ((torch.bfloat16, "ptr"), (torch.bfloat16, "tma"),
                         (torch.float16, "ptr"), (torch.float32, "ptr")):  # fmt: skip
        for D in (64, 128):
            name = f"cuda-{str(dtype).removeprefix('torch.')}-{loads}-{D}"
            default = (dtype, loads, D) in GATED_GPU_DEFAULT
            marks = gpu if default else [*gpu, pytest.mark.exhaustive]
            cases.append(pytest.param("cuda", dtype, loads, D, marks=marks, id=name))
    return cases


@pytest.mark.parametrize("device, dtype, loads, D", _gated_cases(), indirect=["device"])
def test_causal_and_key_bias_match_reference(device, dtype, loads, D, monkeypatch):
    """Causal masking and the per-key bias (with its gradient), alone and together, on odd lengths
    with padding and on an unpadded batch (at head dim 128 in 16 bits: the dense kernels); on the
    GPU also length 1, all but one padded, whole tiles, and the exact sigmoid in bf16."""
    _use_loads(loads, monkeypatch)
    gen = _generator(device)
    exact_too = device == "cuda" and dtype == torch.bfloat16 and loads == "ptr"
    cases = ("odd", "full") if device == "cpu" else tuple(SHAPES["cuda"])
    for case in cases:
        T, lengths = SHAPES[device][case]
        for causal, kind in GATED[device]:
            for exact in [False, True] if exact_too else [False]:
                where = f"{case} causal={causal} key_bias={kind} exact={exact}"
                _check_against_reference(
                    device, dtype, D, T, lengths, exact, gen, where, causal=causal, key_bias=kind
                )


@pytest.mark.interpreter
@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)], ids=["tall", "wide"])
def test_causal_splits_hold_for_unequal_tiles(blocks, monkeypatch):
    """The causal loop bounds for query tiles taller than key tiles and the reverse (the GPU's
    configs have both): the diagonal's masked stretch, the skipped tiles, the dK/dV query loop
    starting at its own diagonal. Float32, odd lengths, a length-1 sequence."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sa, "INTERPRETER_BLOCKS", {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]})
    gen = _generator("cpu")
    for case in ("odd", "len1"):
        T, lengths = SHAPES["cpu"][case]
        where = f"{case}, tiles {blocks}"
        _check_against_reference(
            "cpu", torch.float32, 64, T, lengths, False, gen, where, causal=True, key_bias="BT"
        )


def _check_fused_gate(device, dtype, D, T, lengths, exact, gen, where, causal, kind):
    """The fused gate (``gate_BT`` / ``gate_BHT``) against the reference with the gate applied as
    the model applies it, ``key_bias = log(g + 1e-8)`` and ``g * v`` at v's dtype: output and the
    gradients of q, k, v and g (autograd through the reference), float64 / the dtype / the kernel
    by the criterion. The gate: float32 as the model's, spread over (0, 1) with many near 0 (where
    its gradient 1 / (g + eps) is largest), 0 at padded keys for the references and NaN for the
    kernel, which must not read them."""
    B, H = len(lengths), 2
    (q, k, v), (qn, kn, vn), lengths_B = _inputs(B, H, T, D, lengths, dtype, device, gen)
    valid_BT = key_mask_BT(lengths_B, T)
    valid = valid_BT if kind == "BT" else valid_BT[:, None]
    gate = torch.rand(valid.shape[:1] + ((H,) if kind == "BHT" else ()) + (T,), generator=gen,
                      device=device) ** 3 * valid  # fmt: skip
    gate_nan = gate.masked_fill(~valid, float("nan"))
    rows = valid_BT[:, None, :, None]
    g = torch.randn(B, H, T, D, generator=gen, device=device).to(dtype)
    g_nan, g = g.masked_fill(~rows, float("nan")), g * rows

    def reference(q, k, v, gate):
        g_BHT1 = (gate[:, None] if kind == "BT" else gate)[..., None]
        kb = {f"key_bias_{kind}": torch.log(gate + 1e-8)}
        out = sigmoid_attention_reference(q, k, v * g_BHT1.to(v.dtype), lengths_B, causal=causal,
                                          **kb)  # fmt: skip
        return out.detach(), torch.autograd.grad(out, (q, k, v, gate), g.to(out.dtype))

    fresh = lambda *ts: [t.detach().clone().requires_grad_() for t in ts]
    out64, grads64 = reference(*fresh(q.double(), k.double(), v.double(), gate.double()))
    out_t, grads_t = reference(*fresh(q, k, v, gate))
    leaves = fresh(qn, kn, vn, gate_nan)
    out, _ = sigmoid_attention(*leaves[:3], lengths_B, exact=exact, causal=causal,
                               **{f"gate_{kind}": leaves[3]})  # fmt: skip
    grads = torch.autograd.grad(out, leaves, g_nan)

    assert out.dtype == dtype and grads[3].dtype == torch.float32, where
    assert _err(out, out64) <= 2 * _err(out_t, out64) + ATOL[dtype], where
    for name, a, t_, r in zip(["q", "k", "v", "gate"], grads, grads_t, grads64, strict=True):
        assert torch.isfinite(a).all(), f"d{name} not finite, {where}"
        assert _err(a, r) <= 3 * _err(t_, r) + ATOL[dtype], f"d{name}, {where}"
    for b, L in enumerate(lengths):
        assert (out[b, :, L:] == 0).all(), f"padded query rows must be zero, {where}"
        assert (grads[3][b, ..., L:] == 0).all(), f"padded keys: zero gate gradient, {where}"


def _fused_gate_cases() -> list:
    """(device, dtype, loads, D, causal, kind, shapes): in the interpreter fp16 and fp32, both gate
    layouts, causal or not, pointer and TMA loads, an unpadded head-dim-128 batch (which the
    ungated op sends to the dense kernels); on the GPU bf16 at the KV study's head dim 64 and at
    128 with TMA, causal with a shared gate, every length case, both sigmoid modes."""
    f16, f32, bf16 = torch.float16, torch.float32, torch.bfloat16
    cpu = [(f16, "ptr", 64, True, "BT", ("odd", "len1", "whole_tiles")),
           (f32, "ptr", 64, False, "BHT", ("odd",)), (f16, "tma", 64, True, "BHT", ("odd",)),
           (f16, "ptr", 128, True, "BT", ("full",))]  # fmt: skip
    cases = [pytest.param("cpu", *c, id=f"cpu-{c[0]}-{c[1]}-{c[2]}-causal{c[3]}-{c[4]}"[:60])
             for c in cpu]  # fmt: skip
    for loads, D in (("ptr", 64), ("tma", 128)):
        cases.append(pytest.param("cuda", bf16, loads, D, True, "BT", tuple(SHAPES["cuda"]),
                                  marks=gpu, id=f"cuda-bfloat16-{loads}-{D}"))  # fmt: skip
    return cases


@pytest.mark.parametrize(
    "device, dtype, loads, D, causal, kind, shapes", _fused_gate_cases(), indirect=["device"]
)
def test_fused_gate_matches_the_reference_gate(device, dtype, loads, D, causal, kind, shapes,
                                               monkeypatch):  # fmt: skip
    """``gate_BT`` / ``gate_BHT``: log(g + 1e-8) on the logits and g on the values inside the
    kernels, d g out of the dK/dV kernel, against the reference with the gate outside."""
    _use_loads(loads, monkeypatch)
    gen = _generator(device)
    for case in shapes:
        T, lengths = SHAPES[device][case]
        for exact in [False, True] if device == "cuda" else [False]:
            where = f"{case} exact={exact}"
            _check_fused_gate(device, dtype, D, T, lengths, exact, gen, where, causal, kind)


@pytest.mark.parametrize("case", ["odd", "full"])
def test_gated_causal_backward_is_bitwise_reproducible(device, case):
    """Two forward and backward runs on the same inputs give the same bits, the key bias's
    gradient included (reduced in a fixed order per key tile, summed over heads by torch): no
    atomics anywhere. Padded (general kernels) and unpadded at head dim 128 (dense kernels)."""
    gen = _generator(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    T, lengths = SHAPES[device][case]
    _, (q, k, v), lengths_B = _inputs(2, 2, T, 128, lengths, dtype, device, gen)
    _, kb_nan = _gate_bias("BT", 2, 2, T, lengths_B, gen, device)
    g = torch.randn(q.shape, generator=gen, device=device).to(dtype)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, kb_nan["key_bias_BT"])]
        out, _ = sigmoid_attention(*leaves[:3], lengths_B, causal=True, key_bias_BT=leaves[3])
        runs.append((out, *torch.autograd.grad(out, leaves, g)))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dkey_bias"], *runs, strict=True):
        assert torch.equal(a, b), name


def test_bias_scale_and_no_max(device):
    """A given scale and bias, forward and backward (the backward's fixed-bias path)."""
    gen = _generator(device)
    T, lengths = SHAPES[device]["odd"]
    (q, k, v), (qn, kn, vn), lengths_B = _inputs(2, 1, T, 64, lengths, torch.float32, device, gen)
    g = torch.randn(2, 1, T, 64, generator=gen, device=device)
    g = g * key_mask_BT(lengths_B, T)[:, None, :, None]
    leaves = [t.detach().requires_grad_() for t in (qn, kn, vn)]
    out, max_BH = sigmoid_attention(*leaves, lengths_B, scale=0.3, bias=-2.0)
    assert max_BH is None
    grads = torch.autograd.grad(out, leaves, g)
    kw = {"scale": 0.3, "bias": -2.0}
    ref, grads64 = _ref_grads(q.double(), k.double(), v.double(), lengths_B, g, **kw)
    out_t, grads_t = _ref_grads(q, k, v, lengths_B, g, **kw)
    assert _err(out, ref) <= 2 * _err(out_t, ref) + ATOL[torch.float32]
    for name, a, t_, r in zip("qkv", grads, grads_t, grads64, strict=True):
        assert _err(a, r) <= 3 * _err(t_, r) + ATOL[torch.float32], f"d{name}"
    default_bias, default_grads = _ref_grads(
        q.double(), k.double(), v.double(), lengths_B, g, scale=0.3
    )
    assert _err(default_bias, ref) > 1e-2, "test must be able to tell the bias apart"
    assert _err(default_grads[0], grads64[0]) > 1e-2, "and the bias's gradients"


@pytest.mark.interpreter
@pytest.mark.parametrize("kw", [{"scale": True}, {"bias": True}, {"scale": 0.0}])
def test_bool_or_zero_scale_and_bool_bias_are_refused(kw, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, L = _bad_inputs("cpu")
    with pytest.raises(ValueError, match="scale must be|bias must be"):
        sigmoid_attention(q, q, q, L, **kw)
    import numpy as np

    out, _ = sigmoid_attention(q, q, q, L, scale=np.float64(0.2), bias=np.float32(-1.0))
    assert torch.isfinite(out).all()  # numpy scalars are numbers


def test_strided_views_equal_contiguous(device):
    gen = _generator(device)
    T, lengths = SHAPES[device]["odd"]
    (q, k, v), _, lengths_B = _inputs(2, 2, T, 64, lengths, torch.float16, device, gen)
    assert not q.is_contiguous()
    out_view, _ = sigmoid_attention(q, k, v, lengths_B)
    out_copy, _ = sigmoid_attention(q.contiguous(), k.contiguous(), v.contiguous(), lengths_B)
    assert torch.equal(out_view, out_copy)
    # The output is laid out (B, T, H, D) so the model's transpose(1, 2).reshape is a free view.
    assert out_view.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("D", [64, 128])
def test_max_abs_logit_matches_reference(device, D):
    gen = _generator(device)
    T, lengths = SHAPES[device]["odd"]
    dtype = torch.float16
    (q, k, _), (qn, kn, _), lengths_B = _inputs(2, 3, T, D, lengths, dtype, device, gen)
    got = max_abs_logit(qn, kn, lengths_B)
    ref = max_abs_logit_reference(q.double(), k.double(), lengths_B)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-4, atol=1e-5)
    got_scaled = max_abs_logit(qn, kn, lengths_B, scale=0.5)
    torch.testing.assert_close(
        got_scaled.double(), ref.double() * 0.5 * D**0.5, rtol=1e-4, atol=1e-5
    )
    # The softmax arm's standalone reduction and the sigmoid forward's fused max are one quantity,
    # causal or not; a key bias is no part of it.
    v = torch.zeros_like(qn)
    kb = torch.full(lengths_B.shape + (T,), 50.0, device=device)
    for causal in (False, True):
        alone = max_abs_logit(qn, kn, lengths_B, causal=causal)
        ref = max_abs_logit_reference(q.double(), k.double(), lengths_B, causal=causal)
        torch.testing.assert_close(alone.double(), ref.double(), rtol=1e-4, atol=1e-5)
        _, fused = sigmoid_attention(
            qn, kn, v, lengths_B, return_max_logit=True, causal=causal, key_bias_BT=kb
        )
        if device == "cpu":
            assert torch.equal(fused, alone)
        else:  # each kernel autotuned with its own tiles
            torch.testing.assert_close(fused, alone, rtol=1e-5, atol=1e-6)
    assert (alone <= got).all(), "the causal maximum is over a subset of the full one's logits"
    # And it can be smaller: a logit only the full maximum sees. Key L-1 made 8 q_0 (its logit
    # with query 0 is 8 |q_0|^2 / sqrt(D), far above the random ones), query L-1 made 0, so
    # every causal logit with key L-1 (query L-1's own) is 0. Random inputs alone leave the
    # maximum in the causal triangle for every head now and then.
    qc, kc = qn.clone(), kn.clone()
    for b, L in enumerate(lengths_B.tolist()):
        kc[b, :, L - 1] = 8 * qc[b, :, 0]
        qc[b, :, L - 1] = 0
    full, causal_only = (max_abs_logit(qc, kc, lengths_B, causal=c) for c in (False, True))
    assert (causal_only < full).all(), "the causal maximum must be able to differ from the full one"


def test_max_logit_is_nan_where_a_score_is_nan(device):
    """The max|logit| exists to catch a blow-up, so it must not hide one: one NaN in q makes its
    head's maximum NaN (a float max skips it), a head whose valid q rows are all NaN reports NaN
    (not 0), the other heads keep the reference's values, and the NaN padding is still never
    read. The fused max of the general (padded) and dense (unpadded) forwards, and the standalone
    reduction."""
    gen = _generator(device)
    for case in ("odd", "full"):
        T, lengths = SHAPES[device][case]
        (q, k, _), (qn, kn, vn), lengths_B = _inputs(
            2, 3, T, 128, lengths, torch.float16, device, gen
        )
        for t in (q, qn):  # views into the inputs' (B, T, 3, H, D) storage
            t[0, 0, lengths[0] // 2, 5] = float("nan")
            t[1, 2, : lengths[1]] = float("nan")
        assert sa.use_dense(lengths_B, qn, kn, vn) is (case == "full")
        want = max_abs_logit_reference(q.double(), k.double(), lengths_B)
        assert want[0, 0].isnan() and want[1, 2].isnan() and want.isnan().sum() == 2
        _, fused = sigmoid_attention(qn, kn, vn, lengths_B, return_max_logit=True)
        alone = max_abs_logit(qn, kn, lengths_B)
        for name, got in (("fused", fused), ("standalone", alone)):
            where = f"{name}, {case}"
            assert torch.equal(got.isnan(), want.isnan()), f"{where}: {got}"
            torch.testing.assert_close(
                got.double(), want.double(), rtol=1e-4, atol=1e-5, equal_nan=True, msg=where
            )


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter
def test_an_inf_in_a_valid_position_gives_what_the_reference_gives(device):
    """An inf in q (or k) makes its logits +-inf: the reference gives max|logit| = inf and, for
    sigmoid, a finite output (sigmoid(+-inf) is 1 or 0). The kernels read padding as zeros, and
    q . 0 = inf * 0 = NaN: before the fix, that NaN reached the max (NaN instead of inf) and the
    sigmoid output of the inf row, whenever the last key tile held keys past L (padding, or a T
    that is not a multiple of the tile). Now padding never reaches a result: the kernels agree
    with the reference on which values are NaN / inf, and on the finite ones. Sigmoid (general
    and dense forwards, causal or not), softmax and the standalone max."""
    from stabilitylab.kernels import softmax_attention
    from stabilitylab.kernels.reference import softmax_attention_reference

    def pattern(x):
        return x.isnan().to(torch.int8) + 2 * x.isinf().to(torch.int8)

    def agree(got, want, what, want_t=None):
        """Same NaN / inf pattern; on the finite values the file's criterion against the
        reference at the kernel's dtype (``want_t``), or 1e-2 where none is given (max logits)."""
        assert torch.equal(pattern(got), pattern(want)), f"{what}: {got.flatten()[:8]}"
        finite = torch.isfinite(want)
        err = _err(got[finite], want[finite])
        bound = 1e-2 if want_t is None else 2 * _err(want_t[finite], want[finite]) + ATOL[got.dtype]
        assert err <= bound, f"{what}: max error {err} > {bound}"

    gen = _generator(device)
    for case in ("odd", "full"):
        T, lengths = SHAPES[device][case]
        for inf_in in ("q", "k"):
            (q, k, v), _, lengths_B = _inputs(2, 2, T, 128, lengths, torch.float16, device, gen)
            (q, k) = (t.abs() for t in (q, k))  # one sign for every term: a logit is +inf, no NaN
            (q if inf_in == "q" else k)[:, 1, 2, 0] = float("inf")
            q64, k64, v64 = (t.double() for t in (q, k, v))
            for causal in (False, True):
                where = f"{case}, inf in {inf_in}, causal={causal}"
                want_max = max_abs_logit_reference(q64, k64, lengths_B, causal=causal)
                assert want_max[:, 1].isinf().all() and want_max[:, 0].isfinite().all()
                out, mx = sigmoid_attention(
                    q, k, v, lengths_B, return_max_logit=True, causal=causal
                )
                ref = sigmoid_attention_reference(q64, k64, v64, lengths_B, causal=causal)
                ref_t = sigmoid_attention_reference(q, k, v, lengths_B, causal=causal)
                agree(out, ref, f"sigmoid out, {where}", ref_t)
                agree(mx, want_max, f"sigmoid max, {where}")
                out, mx = softmax_attention(
                    q, k, v, lengths_B, return_max_logit=True, causal=causal
                )
                ref = softmax_attention_reference(q64, k64, v64, lengths_B, causal=causal)
                ref_t = softmax_attention_reference(q, k, v, lengths_B, causal=causal)
                agree(out, ref, f"softmax out, {where}", ref_t)
                agree(mx, want_max, f"softmax max, {where}")
                agree(max_abs_logit(q, k, lengths_B, causal=causal), want_max, f"max, {where}")


def _bad_inputs(device):
    q = torch.randn(2, 2, 8, 64, device=device)
    L = torch.tensor([8, 3], device=device)
    return q, L


BAD = {
    "rank": (lambda q, L: (q[0], q[0], q[0], L), "rank 4"),
    "shape": (lambda q, L: (q, q[:, :, :4], q, L), "shape mismatch"),
    "head_dim": (lambda q, L: (q[..., :32], q[..., :32], q[..., :32], L), "head dim"),
    "dtype_mismatch": (lambda q, L: (q, q.half(), q, L), "dtype mismatch"),
    "dtype": (lambda q, L: (q.double(),) * 3 + (L,), "unsupported dtype"),
    "lengths_shape": (lambda q, L: (q, q, q, L[:1]), r"shape \(B,\)"),
    "lengths_dtype": (lambda q, L: (q, q, q, L.float()), "int32 or int64"),
    "lengths_zero": (lambda q, L: (q, q, q, L * 0), r"\[1, T=8\]"),
    "lengths_long": (lambda q, L: (q, q, q, L + 1), r"\[1, T=8\]"),
    "lengths_device": (lambda q, L: (q, q, q, L.to("meta")), "device mismatch"),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", sorted(BAD))
def test_value_errors(bad, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    make, msg = BAD[bad]
    args = make(*_bad_inputs("cpu"))
    with pytest.raises(ValueError, match=msg):
        sigmoid_attention(*args)
    with pytest.raises(ValueError, match=msg):
        max_abs_logit(args[0], args[1], args[3])


KEY_BIAS_BAD = {
    "both": ({"key_bias_BT": torch.zeros(2, 8), "key_bias_BHT": torch.zeros(2, 2, 8)},
             "key_bias_BT or key_bias_BHT"),
    "bt_shape": ({"key_bias_BT": torch.zeros(2, 7)}, r"key_bias_BT must have shape \(2, 8\)"),
    "bht_shape": ({"key_bias_BHT": torch.zeros(2, 8)},
                  r"key_bias_BHT must have shape \(2, 2, 8\)"),
    "dtype": ({"key_bias_BT": torch.zeros(2, 8, dtype=torch.float64)},
              "key_bias_BT has unsupported dtype"),
    "device": ({"key_bias_BHT": torch.zeros(2, 2, 8, device="meta")},
               "device mismatch: q_BHTD cpu vs key_bias_BHT meta"),
    "not_tensor": ({"key_bias_BT": [[0.0] * 8] * 2}, "key_bias_BT must be a torch.Tensor"),
    "causal": ({"causal": 1}, "causal must be a bool"),
    "gate_and_bias": ({"gate_BT": torch.ones(2, 8), "key_bias_BT": torch.zeros(2, 8)},
                      "pass a gate .* or a key bias .*, not both"),
    "gate_both": ({"gate_BT": torch.ones(2, 8), "gate_BHT": torch.ones(2, 2, 8)},
                  "gate_BT or gate_BHT"),
    "gate_shape": ({"gate_BHT": torch.ones(2, 8)}, r"gate_BHT must have shape \(2, 2, 8\)"),
}  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", sorted(KEY_BIAS_BAD))
def test_key_bias_and_causal_errors_name_the_argument(bad, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, L = _bad_inputs("cpu")
    kw, msg = KEY_BIAS_BAD[bad]
    with pytest.raises(ValueError, match=msg):
        sigmoid_attention(q, q, q, L, **kw)
    if bad == "causal":
        with pytest.raises(ValueError, match=msg):
            max_abs_logit(q, q, L, causal="yes")


@pytest.mark.interpreter
def test_lengths_rechecked_after_in_place_change(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(2, 1, 16, 64)
    L = torch.tensor([16, 5])
    sigmoid_attention(q, q, q, L)
    L[1] = 17
    with pytest.raises(ValueError, match=r"\[1, T=16\]"):
        sigmoid_attention(q, q, q, L)


def test_cpu_without_interpreter_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, L = _bad_inputs("cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        sigmoid_attention(q, q, q, L)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        max_abs_logit(q, q, L)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_device_mismatch_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, L = _bad_inputs("cuda")
    with pytest.raises(ValueError, match="device mismatch"):
        sigmoid_attention(q, q.cpu(), q, L)
    with pytest.raises(ValueError, match="device mismatch"):
        sigmoid_attention(q, q, q, L.cpu())


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "causal-key_bias"])
@pytest.mark.parametrize(
    "backend",
    [pytest.param("aot_eager", marks=pytest.mark.interpreter), pytest.param("inductor", marks=gpu)],
)  # aot_eager: CPU (interpreter) check of graph capture, fake shapes/strides and the autograd path
def test_torch_compile_fullgraph_no_break(backend, gated, monkeypatch):
    """fullgraph=True raises on any graph break. The ops are opaque custom ops, so the compiled
    values must meet the same float64 criterion as eager; the standalone max|logit| op too. Gated:
    causal with a key bias (B, T) that gets its gradient through the op."""
    device = "cuda" if backend == "inductor" else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    gen = _generator(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T, lengths = (300, [300, 171]) if device == "cuda" else (37, [37, 19])
    (q, k, v), _, lengths_B = _inputs(2, 2, T, 64, lengths, dtype, device, gen)
    g = torch.randn(2, 2, T, 64, generator=gen, device=device).to(dtype)
    g = g * key_mask_BT(lengths_B, T)[:, None, :, None]
    kb, _ = _gate_bias("BT" if gated else None, 2, 2, T, lengths_B, gen, device)

    def step(q, k, v, lengths_B, *key_bias_BT):
        out, m = sigmoid_attention(
            q, k, v, lengths_B, return_max_logit=True, causal=gated,
            key_bias_BT=key_bias_BT[0] if gated else None,
        )  # fmt: skip
        # A consumer of the output inside the graph, as the model's output projection is.
        out2 = out.transpose(1, 2).reshape(2, T, -1) * 2.0
        return out2, m, max_abs_logit(q, k, lengths_B, causal=gated)

    leaves = [t.detach().requires_grad_() for t in (q, k, v, *kb.values())]
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out2, max_BH, max2_BH = compiled(*leaves[:3], lengths_B, *leaves[3:])
    out = (out2 / 2.0).reshape(2, T, 2, 64).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, g)
    kb64 = {name: t.double() for name, t in kb.items()}
    out64, grads64 = _ref_grads(
        q.double(), k.double(), v.double(), lengths_B, g, kb64, causal=gated
    )
    out_t, grads_t = _ref_grads(q, k, v, lengths_B, g, kb, causal=gated)
    atol = ATOL[dtype]
    assert _err(out, out64) <= 2 * _err(out_t, out64) + atol
    assert len(grads) == (4 if gated else 3)
    for a, t_, r in zip(grads, grads_t, grads64, strict=True):
        assert _err(a, r) <= 3 * _err(t_, r) + atol
    max_ref = max_abs_logit_reference(q.double(), k.double(), lengths_B, causal=gated)
    torch.testing.assert_close(max_BH.double(), max_ref.double(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(max2_BH.double(), max_ref.double(), rtol=1e-4, atol=1e-5)


@pytest.mark.interpreter
def test_lengths_out_of_range_raise_under_torch_compile(monkeypatch):
    """torch.compile traces without the lengths' range check (a data-dependent branch), so the
    compiled graph would hand the kernels any lengths: past T they read past the buffers. The op
    checks them again at launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    q = torch.randn(2, 1, 37, 64)

    def attention(q, lengths_B):
        return sigmoid_attention(q, q, q, lengths_B, return_max_logit=True)

    for fn in (attention, lambda q, lengths_B: max_abs_logit(q, q, lengths_B)):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        compiled(q, torch.tensor([37, 19]))
        for bad in ([37, 0], [37, 5000]):
            with pytest.raises(ValueError, match=r"lengths_B must lie in \[1, T=37\]"):
                compiled(q, torch.tensor(bad))


@pytest.mark.interpreter
def test_one_compiled_graph_serves_every_sequence_length(monkeypatch):
    """The fast training step marks the sequence length dynamic (``stabilitylab.train.fast``):
    the ops' fake implementations must trace with a symbolic T, so batches of other lengths reuse
    the graph, and the compiled values equal the eager op's at each length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def attention(q, lengths_B):
        out, m = sigmoid_attention(q, q, q, lengths_B, return_max_logit=True)
        return out.transpose(1, 2).flatten(2), m

    compiled = torch.compile(attention, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for T in (37, 45, 29):
        q = torch.randn(2, 1, T, 64, generator=gen)
        torch._dynamo.maybe_mark_dynamic(q, 2)
        lengths_B = torch.tensor([T, T // 2])
        for got, want in zip(compiled(q, lengths_B), attention(q, lengths_B), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.frame_count == 1


@pytest.mark.interpreter
def test_eager_calls_read_the_lengths_once_even_in_inference_mode(monkeypatch):
    """The launch-time range check is for compiled graphs only: an eager call reads its lengths
    once (validation), also under inference_mode, where the memo cannot hold the tensor."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reads, aminmax = [], torch.aminmax

    def counting(*args, **kwargs):
        reads.append(1)
        return aminmax(*args, **kwargs)

    monkeypatch.setattr(torch, "aminmax", counting)
    q = torch.randn(2, 1, 37, 64)
    with torch.inference_mode():
        lengths_B = torch.tensor([37, 19])
        sigmoid_attention(q, q, q, lengths_B)
        assert len(reads) == 1
        max_abs_logit(q, q, lengths_B)
        assert len(reads) == 2


@pytest.mark.parametrize("gated", [False, True, "fused"], ids=["plain", "causal-key_bias",
                                                               "causal-fused_gate"])  # fmt: skip
def test_custom_op_path_equals_the_eager_function(device, gated):
    """torch.compile goes through the custom ops, eager through an autograd.Function: both must
    launch the same kernels, so outputs, max|logit| and gradients agree bit for bit (the key
    bias's or the fused gate's too; without one the ops' trailing arguments keep their
    defaults)."""
    from stabilitylab.kernels.sigmoid_attention import _EagerSigmoidAttention, _fwd_op

    gen = _generator(device)
    T, lengths = SHAPES[device]["odd"]
    _, (qn, kn, vn), lengths_B = _inputs(2, 2, T, 64, lengths, torch.float16, device, gen)
    _, kb = _gate_bias("BT" if gated else None, 2, 2, T, lengths_B, gen, device)
    if gated == "fused":  # a gate in (0, 1), not its log
        kb = {"gate_BT": kb["key_bias_BT"].exp()}
    g = torch.randn(qn.shape, generator=gen, device=device).to(qn.dtype)
    args = (lengths_B, 0.125, 0.0, True, 0, True)
    results = []
    for fn in (_fwd_op, _EagerSigmoidAttention.apply):
        leaves = [t.detach().clone().requires_grad_() for t in (qn, kn, vn, *kb.values())]
        tail = (True, leaves[3][:, None].expand(2, 2, T)) if gated else ()
        tail += (True,) if gated == "fused" else ()
        out, max_BH = fn(*leaves[:3], *args, *tail)
        results.append((out, max_BH, *torch.autograd.grad(out, leaves, g)))
    assert len(results[0]) == (6 if gated else 5)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.interpreter
def test_tma_refuses_unaligned_strides_and_the_op_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 2, 33, 65)[..., :64]  # row stride 65 floats = 260 bytes
    xc = x.contiguous()
    lengths = torch.tensor([33])
    assert not sa.tma_ok(x, x, x) and sa.tma_ok(xc, xc, xc)
    assert not sa.use_tma(xc, xc, xc), "T = 33 is below TMA_MIN_T: pointer loads"
    monkeypatch.setattr(sa, "TMA_MIN_T", 1)  # the op would now take TMA wherever it can
    assert sa.use_tma(xc, xc, xc) and not sa.use_tma(x, x, x)
    out, _ = sigmoid_attention(x, x, x, lengths)  # unaligned: the op takes pointer loads
    ref = sigmoid_attention_reference(x.double(), x.double(), x.double(), lengths)
    assert _err(out, ref) <= 1e-4


def test_autotune_choices_name_kernel_key_and_config():
    from types import SimpleNamespace

    import triton

    from stabilitylab.kernels.triton_support import autotune_choices

    fn = SimpleNamespace(__name__="_sigmoid_fwd_kernel")
    tuner = SimpleNamespace(
        base_fn=fn, cache={(8192, 64): triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=3)}
    )
    got = autotune_choices({("k", (9, 0), False): tuner, "untuned": SimpleNamespace(cache={})})
    assert list(got) == ["_sigmoid_fwd_kernel[8192, 64]"]
    assert "BLOCK_M: 128" in got["_sigmoid_fwd_kernel[8192, 64]"]
    assert "num_warps: 8" in got["_sigmoid_fwd_kernel[8192, 64]"]


def test_each_specialisation_is_autotuned_on_its_own(monkeypatch):
    """A config tuned on aligned inputs is never launched on unaligned ones: on the H200 such a
    forward config ran out of shared memory (row stride 129). The op keeps one autotuner per Triton
    specialisation of the launch arguments."""
    from stabilitylab.kernels.triton_support import specialization

    x = torch.zeros(64, dtype=torch.float16)
    assert specialization(x, x[1:], 1, 32, 129, True, 0.5) == (True, False, 1, 16, 0)

    made = []

    class FakeTuned:
        def __init__(self, kernel, configs, key_names):
            self.keys = []
            made.append(self)

        def launch(self, grid, key, *args, **kwargs):
            self.keys.append(key)

    monkeypatch.setattr(sa, "Tuned", FakeTuned)
    monkeypatch.setattr(sa, "_TUNED", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 1, 64, 64, dtype=torch.float16)
    levers = dict(HEAD_DIM=64, TMA=False, SIGMOID=1, A_REGS=False)
    for stride in (64, 64, 129):  # a row stride of 129 values: another specialisation
        sa._launch(sa._sigmoid_fwd_kernel, "fwd", q, (1,), (q, stride, 64), levers)
    assert [len(t.keys) for t in made] == [2, 1]
    assert made[0].keys[0] == made[1].keys[0]  # the same autotune key, tuned twice

    # CAUSAL and HAS_KEY_BIAS select code paths: in the key. The key bias's alignment: in the
    # specialisation (an aligned and an unaligned one are tuned apart).
    made.clear()
    monkeypatch.setattr(sa, "_TUNED", {})
    kb = torch.zeros(80)
    for causal, key_bias in ((False, None), (True, None), (True, kb[:64]), (True, kb[1:65])):
        extra = {"CAUSAL": causal, "HAS_KEY_BIAS": key_bias is not None}
        if key_bias is not None:
            extra.update(KB=key_bias, skbb=64, skbh=0)
        sa._launch(sa._sigmoid_fwd_kernel, "fwd", q, (1,), (q, 64, 64), {**levers, **extra})
    assert [len(t.keys) for t in made] == [2, 1, 1]
    assert len({key for t in made for key in t.keys}) == 3
    assert made[1].keys == made[2].keys


def test_tuned_autotunes_once_per_key_then_launches_straight():
    """The launcher pays the autotuner's dispatch only at a key's first call; later calls launch
    the JIT kernel with the chosen config's kwargs."""
    from types import SimpleNamespace

    import triton

    from stabilitylab.kernels.triton_support import Tuned, autotune_choices

    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name
            self.best_config = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)
            self.cache = {(4096, 64): self.best_config}
            self.base_fn = SimpleNamespace(__name__="_k")

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.name, args, kwargs))

    tuned = Tuned.__new__(Tuned)
    tuned.jit, tuned.tuner, tuned._best, tuned._hook = Fake("jit"), Fake("tuner"), {}, {}
    for key in [("T4096",), ("T4096",), ("T8192",), ("T4096",)]:
        tuned.launch(None, key, 1, 2, HEAD_DIM=64)
    assert [c[0] for c in calls] == ["tuner", "jit", "tuner", "jit"]
    _, args, kwargs = calls[1]
    assert args == (1, 2) and kwargs["HEAD_DIM"] == 64
    assert kwargs["BLOCK_M"] == 64 and kwargs["num_warps"] == 4 and kwargs["num_stages"] == 2
    assert "BLOCK_M: 64" in autotune_choices({"k": tuned})["_k[4096, 64]"]  # run provenance

    # A config with a pre-hook (the dense kernels' descriptor blocks): straight launches run it
    # too, on the keyword arguments and the config's, before launching.
    tuner = Fake("tuner")
    tuner.best_config = triton.Config(
        {"BLOCK_M": 32}, num_warps=4, num_stages=2,
        pre_hook=lambda nargs: calls.append(("hook", (), nargs)),
    )  # fmt: skip
    tuned.tuner, calls[:] = tuner, []
    tuned.launch(None, ("hooked",), 1, Q_d="desc")  # the tuner runs the hook itself
    tuned.launch(None, ("hooked",), 1, Q_d="desc")
    assert [c[0] for c in calls] == ["tuner", "hook", "jit"]  # the hook before the launch
    assert calls[1][2]["Q_d"] == "desc" and calls[1][2]["BLOCK_M"] == 32


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_straight_launch_equals_the_autotuned_one(monkeypatch):
    """First call (through the autotuner) and second call (straight, same key): same bits."""
    monkeypatch.setattr(sa, "_TUNED", {})  # a fresh launcher: the first call autotunes
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = _generator("cuda")
    T, lengths = SHAPES["cuda"]["odd"]
    _, (qn, kn, vn), lengths_B = _inputs(2, 2, T, 128, lengths, torch.bfloat16, "cuda", gen)
    g = torch.randn(qn.shape, generator=gen, device="cuda").to(qn.dtype)
    results = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (qn, kn, vn)]
        out, max_BH = sigmoid_attention(*leaves, lengths_B, return_max_logit=True)
        results.append((out, max_BH, *torch.autograd.grad(out, leaves, g)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_persistent_grid_takes_the_fewest_programs_for_the_same_rounds(monkeypatch):
    from stabilitylab.kernels import triton_support
    from stabilitylab.kernels.triton_support import cdiv, persistent_grid

    monkeypatch.setattr(triton_support, "persistent_programs", lambda device: 132)
    cpu = torch.device("cpu")
    assert persistent_grid(2048, cpu) == 128  # hd 128: 16 full rounds, not 15.5 on 132 SMs
    assert [persistent_grid(n, cpu) for n in (1, 100, 132, 133, 2112)] == [1, 100, 132, 67, 132]
    for n in range(1, 3000):
        g = persistent_grid(n, cpu)
        assert g <= 132 and cdiv(n, g) == cdiv(n, min(n, 132)), n  # as few rounds as 132 take
        assert g == 1 or cdiv(n, g - 1) > cdiv(n, g), n  # and one program fewer needs more


def test_host_integer_helpers_match_triton():
    """The launchers' plain-int ceiling division and T bucket (cheaper on the host than Triton's
    constexpr functions) agree with ``triton.cdiv`` / ``triton.next_power_of_2``."""
    import triton

    from stabilitylab.kernels.triton_support import cdiv, seq_bucket

    for n in [*range(1, 300), 1023, 1024, 1025, 4095, 4096, 4097, 8191, 8192, 16384, 16385]:
        for b in (16, 32, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
        assert seq_bucket(n) == triton.next_power_of_2(max(n, 16)), n


def test_unpadded_batches_take_the_dense_kernels_with_the_same_results(device, monkeypatch):
    """An unpadded 16-bit batch at head dim 128 goes to the dense kernels (descriptors built on
    the host); head dim 64, a padded, a float32 or an unaligned batch to the general kernels. On
    the same unpadded inputs both give the same outputs, max|logit| and gradients (bit for bit in
    the interpreter, whose tiles are equal; on the GPU each is autotuned alone: within rounding),
    plain and causal with a per-head key bias (and its gradient)."""
    launched, launch = [], sa._launch

    def spy(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(sa, "_launch", spy)
    gen = _generator(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    if device == "cpu":  # tiles of unequal sides, so that a descriptor given the other block fails
        monkeypatch.setattr(sa, "INTERPRETER_BLOCKS", {"BLOCK_M": 32, "BLOCK_N": 16})
    T, lengths = SHAPES[device]["full"]
    production_dims = sa.DENSE_HEAD_DIMS
    # On the GPU also a T below one tile (the autotuned tiles are 64-128 rows).
    cases = [(64, T), (128, T), *([(128, 40)] if device == "cuda" else [])]
    for D, T in cases:
        lengths = [T, T]
        _, (q, k, v), lengths_B = _inputs(2, 2, T, D, lengths, dtype, device, gen)
        g = torch.randn(q.shape, generator=gen, device=device).to(dtype)
        args = (lengths_B, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32)  # exact in the interpreter
        assert sa.use_dense(lengths_B, q, k, v, g) is (D in sa.DENSE_HEAD_DIMS)
        kb = torch.randn(2, 2, T, generator=gen, device=device)
        for causal, key_bias in ((False, None), (True, kb)):
            tail = {"causal": causal, "key_bias": key_bias}
            monkeypatch.setattr(sa, "DENSE_HEAD_DIMS", (D,))  # run the dense kernels at both
            launched.clear()
            out, max_BH = sa.forward_auto(q, k, v, *args, True, **tail)
            *grads, dkb = sa.backward_auto(g, q, k, v, *args, **tail)
            monkeypatch.setattr(sa, "DENSE_HEAD_DIMS", production_dims)
            assert launched == [
                "_sigmoid_fwd_dense_kernel", "_sigmoid_bwd_dq_dense_kernel",
                "_sigmoid_bwd_dkdv_dense_kernel",
            ], launched  # fmt: skip
            assert (dkb is None) is (key_bias is None)
            out_g, max_g = sa._forward(q, k, v, *args, True, True, **tail)  # general, TMA
            dkb_g = None if key_bias is None else torch.empty_like(kb)
            grads_g = sa._backward(g, q, k, v, *args, True, **tail, dkb=dkb_g)
            dense, general = (out, max_BH, *grads, dkb), (out_g, max_g, *grads_g, dkb_g)
            for a, b in zip(dense, general, strict=True):
                if a is None:
                    assert b is None
                elif device == "cpu":
                    assert torch.equal(a, b), (D, causal)
                else:
                    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        # The exact sigmoid's forward keeps the general kernel (``forward_auto``).
        launched.clear()
        monkeypatch.setattr(sa, "DENSE_HEAD_DIMS", (D,))
        sa.forward_auto(q, k, v, *args[:-1], sa.EXACT, False)
        monkeypatch.setattr(sa, "DENSE_HEAD_DIMS", production_dims)
        assert launched == ["_sigmoid_fwd_kernel"], launched

    # Not dense: one sequence padded; float32; a row stride of 129 values (not 16-byte aligned);
    # a head stride of 0 (k and v broadcast over heads with expand).
    T, lengths = SHAPES[device]["odd"]
    (q, k, v), _, padded_B = _inputs(2, 2, T, 128, lengths, dtype, device, gen)
    full_B = torch.full_like(padded_B, T)
    assert sa.use_dense(full_B, q, k, v) and not sa.use_dense(padded_B, q, k, v)
    assert not sa.use_dense(full_B, *(t.float() for t in (q, k, v)))
    x = torch.randn(2, 2, T, 129, device=device, dtype=dtype)[..., :128]
    assert not sa.use_dense(full_B, x, x, x)
    kb, vb = (t[:, :1].expand_as(t) for t in (k, v))
    assert kb.stride(1) == 0 and not sa.use_dense(full_B, q, kb, vb)
    for args in ((x, x, x), (q, kb, vb)):
        launched.clear()
        out, _ = sa.forward_auto(*args, full_B, 1 / math.sqrt(128), 0.0, True, 0, False)
        assert launched == ["_sigmoid_fwd_kernel"]
        ref64 = sigmoid_attention_reference(*(t.double() for t in args), full_B)
        ref_t = sigmoid_attention_reference(*args, full_B)
        assert _err(out, ref64) <= 2 * _err(ref_t, ref64) + ATOL[dtype]


def test_lengths_all_full_reads_the_range_memo():
    from stabilitylab.kernels.triton_support import lengths_all_full

    full, padded = torch.tensor([8, 8]), torch.tensor([8, 3])
    assert lengths_all_full(full, 8) and not lengths_all_full(padded, 8)
    assert not lengths_all_full(full, 9)  # another T, another answer
    with pytest.raises(ValueError, match=r"\[1, T=8\]"):
        lengths_all_full(torch.tensor([8, 9]), 8)
    assert lengths_all_full(full, 8)
    full[0] = 7  # an in-place change bumps the version: read again
    assert not lengths_all_full(full, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_lengths_all_full_is_false_under_cuda_graph_capture():
    """A captured graph may be replayed with other lengths in its static buffer: the op must then
    take the kernels that read the lengths on the device, and it must not sync while capturing."""
    from stabilitylab.kernels.triton_support import lengths_all_full

    full = torch.full((2,), 8, device="cuda")
    assert lengths_all_full(full, 8)  # the memo now holds "full" for this tensor
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        x.add_(1)
        captured = lengths_all_full(full, 8)
    assert captured is False


# The interpreter runs the kernels as Python: a kernel it accepts may still fail in Triton's
# compiler. This compiles the causal + key-bias variant of every kernel for sm_90a without a GPU.
COMPILE_GATED = """
import sys
sys.path.insert(0, sys.argv[1])
import ptx_offline as p
from triton.compiler.compiler import make_backend
sa, launches = p.record_launches(True, seq_lens=(64,))
backend, seen = make_backend(p.TARGET), set()
for kernel, kind, fp32, args, kwargs, dense in launches:
    name = kernel.fn.__name__
    label = name + ("+gate" if kwargs.get("HAS_GATE") else "")
    if label in seen or not (kwargs.get("CAUSAL") and kwargs.get("HAS_KEY_BIAS")):
        continue
    seen.add(label)
    config = sa._configs(kind, (9, 0), fp32, dense)[0]
    kw = {**kwargs, **config.kwargs}
    if config.pre_hook is not None:
        config.pre_hook(kw)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages, "debug": False}
    text = p.ptx(kernel, args, {**kw, **options}, backend)
    print(label, f".entry {name}(" in text, "wgmma.mma_async" in text)
"""


def test_gated_causal_kernels_compile_for_sm90_without_a_gpu():
    """Every kernel (general and dense) with CAUSAL and a key bias, and each general kernel with
    the fused gate (``+gate``), through Triton's compiler up to sm_90a PTX with wgmma, in a process
    of its own (one that imported triton without the interpreter), with
    experiments/bench/ptx_offline.py."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_GATED, str(bench)], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())
    general = ["_sigmoid_fwd_kernel", "_sigmoid_bwd_dq_kernel", "_sigmoid_bwd_dkdv_kernel"]
    kernels = [*general, *(f"{k}+gate" for k in general), "_sigmoid_fwd_dense_kernel",
               "_sigmoid_bwd_dq_dense_kernel", "_sigmoid_bwd_dkdv_dense_kernel"]  # fmt: skip
    assert sorted(compiled) == sorted(kernels)
    assert all(v == "True True" for v in compiled.values()), compiled
