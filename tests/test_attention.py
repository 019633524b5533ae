"""Every attention backend against a float64 reference, with padding."""

import math

import pytest
import torch

from stabilitylab.attention import available, get_backend, max_abs_logit
from stabilitylab.kernels.reference import key_mask_BT

# sigmoid-triton on CPU tensors: Triton's interpreter (tests/conftest.py)
BACKENDS = [pytest.param(n, marks=pytest.mark.interpreter) if n.startswith("sigmoid-triton") else n
            for n in available()]  # fmt: skip


def softmax_reference_f64(q, k, v, lengths):
    q, k, v = q.double(), k.double(), v.double()
    T, D = q.shape[2], q.shape[3]
    valid = key_mask_BT(lengths, T)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.softmax(s, -1) @ v
    return out * valid[:, None, :, None]


def sigmoid_reference_f64(q, k, v, lengths, bias=None):
    q, k, v = q.double(), k.double(), v.double()
    T, D = q.shape[2], q.shape[3]
    valid = key_mask_BT(lengths, T)
    b = (
        -torch.log(lengths.double())
        if bias is None
        else torch.full(lengths.shape, bias, dtype=torch.float64)
    )
    p = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(D) + b[:, None, None, None])
    out = (p * valid[:, None, None, :]) @ v
    return out * valid[:, None, :, None]


def _inputs(B, H, T, D, lengths, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(B, H, T, D, generator=g).to(dtype)
    return mk(), mk(), mk(), torch.tensor(lengths)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bias", [None, -1.5])
def test_backend_matches_float64_reference_with_padding(name, bias):
    seed = torch.randint(0, 2**31, ()).item()
    q, k, v, lengths = _inputs(3, 2, 37, 64, [37, 20, 1], torch.float32, seed)
    out, stats = get_backend(name)(q, k, v, lengths, sigmoid_bias=bias, return_max_logit=True)
    softmax = name.startswith("softmax")
    ref = softmax_reference_f64 if softmax else sigmoid_reference_f64
    expected = ref(q, k, v, lengths) if softmax else ref(q, k, v, lengths, bias)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=2e-4, msg=f"seed {seed}")
    valid = key_mask_BT(lengths, q.shape[2])
    assert (out[~valid[:, None, :, None].expand_as(out)] == 0).all(), (
        "padded query rows must be zero"
    )
    s = (q.double() @ k.double().transpose(-1, -2) / 8.0).abs()
    pair = valid[:, None, :, None] & valid[:, None, None, :]
    exact = s.masked_fill(~pair, 0).amax(dim=(-1, -2))
    torch.testing.assert_close(stats.double(), exact, atol=1e-4, rtol=1e-5, msg=f"seed {seed}")


@pytest.mark.parametrize("name", BACKENDS)
def test_padded_keys_contribute_nothing(name):
    q, k, v, lengths = _inputs(1, 2, 16, 64, [9], torch.float32, 1)
    out1, _ = get_backend(name)(q, k, v, lengths)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 9:] = 1e3
    v2[:, :, 9:] = -1e3
    out2, _ = get_backend(name)(q, k2, v2, lengths)
    torch.testing.assert_close(out1, out2)


def test_softmax_full_length_answer_follows_in_place_changes():
    """The softmax backend remembers whether a lengths tensor is full (one host read, not one per
    layer); an in-place change to that same tensor must be seen, or padded keys would leak in."""
    q, k, v, lengths = _inputs(2, 2, 16, 64, [16, 16], torch.float32, 2)
    softmax = get_backend("softmax")
    full, _ = softmax(q, k, v, lengths)
    tol = {"atol": 2e-4, "rtol": 2e-4}
    torch.testing.assert_close(full.double(), softmax_reference_f64(q, k, v, lengths), **tol)
    lengths[1] = 7  # same tensor object, new version
    padded, _ = softmax(q, k, v, lengths)
    torch.testing.assert_close(padded.double(), softmax_reference_f64(q, k, v, lengths), **tol)
    assert (padded[1, :, 7:] == 0).all()


@pytest.mark.parametrize("bad", [0, 17])
def test_softmax_refuses_lengths_out_of_range(bad):
    """The softmax backend reads its lengths through the kernels' range check (one memo for both
    arms): a length of 0 or beyond T is named, not turned into a silent all-masked row."""
    q, k, v, _ = _inputs(2, 2, 16, 64, [16, 16], torch.float32, 4)
    with pytest.raises(ValueError, match=r"lengths_B must lie in \[1, T=16\]"):
        get_backend("softmax")(q, k, v, torch.tensor([16, bad]))


@pytest.mark.parametrize(
    "name", ["softmax", pytest.param("sigmoid-triton", marks=pytest.mark.interpreter)]
)
def test_backends_run_under_inference_mode(name, monkeypatch):
    """Inference tensors carry no version counter: the lengths caches must not ask for one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # sigmoid-triton on CPU: the interpreter
    with torch.inference_mode():
        q, k, v, lengths = _inputs(2, 2, 16, 64, [16, 9], torch.float32, 3)
        out, _ = get_backend(name)(q, k, v, lengths)
        out2, _ = get_backend(name)(q, k, v, lengths)
    ref = softmax_reference_f64 if name == "softmax" else sigmoid_reference_f64
    torch.testing.assert_close(out.double(), ref(q, k, v, lengths), atol=2e-4, rtol=2e-4)
    assert torch.equal(out, out2)


def test_max_abs_logit_chunks_agree():
    from stabilitylab.kernels.reference import max_abs_logit_reference

    q, k, _, lengths = _inputs(2, 3, 50, 64, [50, 13], torch.float32, 2)
    whole = max_abs_logit_reference(q, k, lengths)
    tiny_chunks = max_abs_logit_reference(q, k, lengths, chunk_elems=2 * 3 * 50 * 3)
    torch.testing.assert_close(whole, tiny_chunks)
    torch.testing.assert_close(max_abs_logit(q, k, lengths), whole)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="flash-sigmoid"):
        get_backend("flash-sigmoid")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_model_with_sigmoid_triton_matches_eager():
    """train.compile with the kernel: the compiled model's loss and gradients equal eager's up to
    bf16 rounding (inductor fuses the rest of the model differently), with padding."""
    import copy

    from stabilitylab.config import ModelConfig
    from stabilitylab.model import Encoder

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=256, n_heads=4, d_ff=1024, dropout=0.0)
    eager = Encoder(cfg, 300, 640, "sigmoid-triton").cuda()
    compiled = copy.deepcopy(eager)
    compiled.compile(fullgraph=True)
    tokens_BT = torch.randint(3, 300, (2, 640), device="cuda")
    lengths_B = torch.tensor([640, 301], device="cuda")
    results = []
    for model in (eager, compiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens_BT, lengths_B).float()
        loss = logits[0, :640].logsumexp(-1).mean() + logits[1, :301].logsumexp(-1).mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((loss.detach(), grads))
    (l_e, g_e), (l_c, g_c) = results
    assert torch.isfinite(l_c) and torch.isfinite(g_c).all()
    assert abs(l_c - l_e) <= 1e-2 * abs(l_e)
    assert (g_c - g_e).norm() <= 3e-2 * g_e.norm()


def test_exact_backend_asks_the_kernel_for_the_exact_sigmoid(monkeypatch):
    import stabilitylab.kernels as kernels

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("exact", False))
        return args[0], None

    monkeypatch.setattr(kernels, "sigmoid_attention", spy)
    q, k, v, lengths = _inputs(1, 1, 8, 64, [8], torch.float32, 0)
    get_backend("sigmoid-triton")(q, k, v, lengths)
    get_backend("sigmoid-triton-exact")(q, k, v, lengths)
    assert seen == [False, True]
