"""Every attention backend against a float64 reference, with padding."""

import math

import pytest
import torch

from stabilitylab.attention import available, get_backend, max_abs_logit
from stabilitylab.kernels.reference import key_mask_BT

# The Triton backends on CPU tensors: Triton's interpreter (tests/conftest.py)
BACKENDS = [pytest.param(n, marks=pytest.mark.interpreter) if "-triton" in n else n
            for n in available()]  # fmt: skip
# softmax-flash takes no padding and no key bias (refused: test_softmax_flash_refuses_by_name)
PADDING_BACKENDS = [b for b in BACKENDS if b != "softmax-flash"]
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


GPU_DEFAULT = {(False, None, None, "padded"), (True, "BHT", -1.5, "full")}
"""The CUDA cases of each Triton backend in ``pytest -m gpu``: (causal, key bias, sigmoid bias,
lengths). Each case compiles and autotunes a kernel specialisation of its own, and the kernels'
own tests (tests/test_kernels.py, tests/test_softmax_kernel.py) sweep causal masking and the key
bias; here one plain case and one with every feature check the backend's wiring. The other 22
per backend are exhaustive."""
LENGTHS = {"padded": (37, 20, 1), "full": (37, 37, 37)}


def _reference_cases() -> list:
    """(backend, device, causal, key bias kind, sigmoid bias, lengths): every backend on CPU
    tensors, the Triton ones in the interpreter without causal masking or a key bias only
    (tests/test_kernels.py covers those there), and on CUDA with all of them (``GPU_DEFAULT`` by
    default, the rest exhaustive)."""
    cases = []
    for name in available():
        for causal in (False, True):
            for kind in (None, "BT", "BHT"):
                for bias in (None, -1.5):
                    for lens in LENGTHS:
                        tag = f"{lens}-{bias}-{name}-{'causal' if causal else 'full'}-{kind or 'nobias'}"  # fmt: skip
                        args = (name, causal, kind, bias, LENGTHS[lens])
                        if "-triton" not in name:
                            cases.append(pytest.param(args[0], "cpu", *args[1:], id=f"{tag}-cpu"))
                            continue
                        if not causal and kind is None:
                            marks = pytest.mark.interpreter
                            cases.append(pytest.param(args[0], "cpu", *args[1:], marks=marks, id=f"{tag}-cpu"))  # fmt: skip
                        default = (causal, kind, bias, lens) in GPU_DEFAULT
                        marks = GPU if default else [*GPU, pytest.mark.exhaustive]
                        cases.append(pytest.param(args[0], "cuda", *args[1:], marks=marks, id=f"{tag}-cuda"))  # fmt: skip
    return cases


def _visible_f64(lengths, T, causal):
    """[b, i, j]: key j visible to query i (written apart from kernels/reference.py)."""
    i = torch.arange(T, device=lengths.device)[:, None]
    j = torch.arange(T, device=lengths.device)[None, :]
    return (j < lengths[:, None, None]) & ((j <= i) if causal else True)


def _bias_f64(kb, q):
    B, H, T, _ = q.shape
    if kb is None:
        return torch.zeros(B, H, 1, T, dtype=torch.float64, device=q.device)
    kb = kb.double()
    return kb[:, None, None, :] if kb.dim() == 2 else kb[:, :, None, :]


def softmax_reference_f64(q, k, v, lengths, causal=False, kb=None):
    q, k, v = q.double(), k.double(), v.double()
    B, H, T, D = q.shape
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + _bias_f64(kb, q)
    s = s.masked_fill(~_visible_f64(lengths, T, causal)[:, None], float("-inf"))
    out = torch.softmax(s, -1) @ v
    return out * key_mask_BT(lengths, T)[:, None, :, None]


def sigmoid_reference_f64(q, k, v, lengths, bias=None, causal=False, kb=None):
    q, k, v = q.double(), k.double(), v.double()
    B, H, T, D = q.shape
    b = (
        -torch.log(lengths.double())
        if bias is None
        else torch.full(lengths.shape, bias, dtype=torch.float64, device=q.device)
    )
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + _bias_f64(kb, q) + b[:, None, None, None]
    p = torch.sigmoid(s) * _visible_f64(lengths, T, causal)[:, None]
    return (p @ v) * key_mask_BT(lengths, T)[:, None, :, None]


def _inputs(B, H, T, D, lengths, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(B, H, T, D, generator=g).to(dtype)
    return mk(), mk(), mk(), torch.tensor(lengths)


def _key_bias(kind, B, H, T, seed):
    """A gate's log(g + 1e-8) with g spread over (0, 1): from about -18 to 0."""
    if kind is None:
        return {}
    g = torch.Generator().manual_seed(seed + 1)
    shape = (B, T) if kind == "BT" else (B, H, T)
    gate = torch.rand(shape, generator=g) ** 3
    return {f"key_bias_{kind}": torch.log(gate + 1e-8)}


@pytest.mark.parametrize("name, device, causal, key_bias, bias, lens", _reference_cases())
def test_backend_matches_float64_reference(name, device, causal, key_bias, bias, lens, seed):
    """Every backend on odd lengths with padding, causal or not, with or without a per-key bias
    (shared or per head): its output and max |logit| against float64 maths."""
    q, k, v, lengths = _inputs(3, 2, 37, 64, list(lens), torch.float32, seed)
    kw = _key_bias(key_bias, 3, 2, 37, seed)
    q, k, v, lengths = (t.to(device) for t in (q, k, v, lengths))
    kw = {name_: t.to(device) for name_, t in kw.items()}
    backend = get_backend(name)
    if name == "softmax-flash" and (kw or min(lens) < 37):
        with pytest.raises(ValueError, match="'softmax-flash' takes no"):
            backend(q, k, v, lengths, causal=causal, **kw)
        return
    out, stats = backend(
        q, k, v, lengths, causal=causal, sigmoid_bias=bias, return_max_logit=True, **kw
    )
    kb = next(iter(kw.values()), None)
    if name.startswith("softmax"):
        expected = softmax_reference_f64(q, k, v, lengths, causal, kb)
    else:
        expected = sigmoid_reference_f64(q, k, v, lengths, bias, causal, kb)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=2e-4, msg=f"seed {seed}")
    valid = key_mask_BT(lengths, q.shape[2])
    assert (out[~valid[:, None, :, None].expand_as(out)] == 0).all(), (
        "padded query rows must be zero"
    )
    s = (q.double() @ k.double().transpose(-1, -2) / 8.0).abs()
    pair = _visible_f64(lengths, 37, causal) & valid[:, :, None]
    exact = s.masked_fill(~pair[:, None], 0).amax(dim=(-1, -2))
    torch.testing.assert_close(stats.double(), exact, atol=1e-4, rtol=1e-5, msg=f"seed {seed}")


GRAD_GPU_DEFAULT = {
    ("softmax-flex", True, "BHT"), ("sigmoid-triton", False, "BT"), ("sigmoid-triton", True, "BHT"),
    ("softmax-triton", True, "BT"), ("sigmoid-triton-exact", True, "BT"),
}  # fmt: skip
"""The CUDA cases in ``pytest -m gpu``: each GPU backend once with causal masking, and the fast
sigmoid without it too (the bias's gradient on both kernels' paths); the other 11 exhaustive."""


def _grad_cases() -> list:
    """(backend, causal, key bias kind): the eager backends on CPU, every case; the GPU ones
    (FlexAttention, the Triton kernels) on CUDA, ``GRAD_GPU_DEFAULT`` by default."""
    cases = []
    for kind in ("BT", "BHT"):
        for causal in (False, True):
            for name in ("softmax", "softmax-reference", "sigmoid-reference", "softmax-flex",
                         "sigmoid-triton", "softmax-triton", "sigmoid-triton-exact"):  # fmt: skip
                marks = []
                if name == "softmax-flex" or "-triton" in name:
                    marks = GPU if (name, causal, kind) in GRAD_GPU_DEFAULT else [*GPU, pytest.mark.exhaustive]  # fmt: skip
                cases.append(pytest.param(name, causal, kind, marks=marks, id=f"{kind}-{causal}-{name}"))  # fmt: skip
    return cases


@pytest.mark.parametrize("name, causal, kind", _grad_cases())
def test_key_bias_gradient_matches_float64_autograd(name, causal, kind):
    """d key_bias (and dq, dk, dv) from each backend against autograd through float64 maths: the
    gate learns through this gradient (sum over queries, and heads for key_bias_BT). The Triton
    backends (head dim 64 or 128) on CUDA; their interpreter runs are in tests/test_kernels.py."""
    device = "cuda" if name == "softmax-flex" or "-triton" in name else "cpu"
    D = 64 if "-triton" in name else 32
    q, k, v, lengths = _inputs(2, 3, 29, D, [29, 12], torch.float32, 7)
    kb = _key_bias(kind, 2, 3, 29, 7)[f"key_bias_{kind}"]
    leaves = [t.to(device).requires_grad_() for t in (q, k, v, kb)]
    lengths = lengths.to(device)
    out, _ = get_backend(name)(
        *leaves[:3], lengths, causal=causal, **{f"key_bias_{kind}": leaves[3]}
    )
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    grads = torch.autograd.grad(out, leaves, d_out)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = softmax_reference_f64 if name.startswith("softmax") else sigmoid_reference_f64
    kw = {"causal": causal, "kb": leaves64[3]}
    out64 = ref(*leaves64[:3], lengths, **kw)
    grads64 = torch.autograd.grad(out64, leaves64, d_out.double())
    assert grads[3].abs().sum() > 0, "the key bias must receive a gradient"
    for label, g, g64 in zip(("q", "k", "v", "key_bias"), grads, grads64, strict=True):
        torch.testing.assert_close(g.double(), g64, atol=1e-4, rtol=1e-4, msg=label)


def test_softmax_flash_refuses_padding_and_key_bias_by_name():
    q, k, v, lengths = _inputs(2, 2, 8, 64, [8, 5], torch.float32, 0)
    flash = get_backend("softmax-flash")
    with pytest.raises(ValueError, match=r"'softmax-flash' takes no padding \(every lengths_B"):
        flash(q, k, v, lengths)
    full = torch.tensor([8, 8])
    with pytest.raises(ValueError, match="'softmax-flash' takes no key_bias_BT / key_bias_BHT"):
        flash(q, k, v, full, key_bias_BHT=torch.zeros(2, 2, 8))
    out, _ = flash(q, k, v, full, causal=True)
    torch.testing.assert_close(
        out.double(), softmax_reference_f64(q, k, v, full, True), atol=2e-4, rtol=2e-4
    )


def test_backends_that_cannot_be_deterministic_are_registered_and_listed_in_the_config():
    """train.deterministic refuses NOT_DETERMINISTIC by name (stabilitylab.config, without torch):
    its names must be registered backends, and the config must offer every softmax backend."""
    from typing import get_args, get_type_hints

    from stabilitylab.config import NOT_DETERMINISTIC, Config

    assert set(NOT_DETERMINISTIC) <= set(available())
    offered = set(get_args(get_type_hints(Config)["softmax_backend"])) - {"auto"}
    assert offered == {n for n in available() if n.startswith("softmax")}


def test_softmax_flex_refuses_backward_on_cpu():
    q, k, v, lengths = _inputs(1, 1, 8, 16, [8], torch.float32, 0)
    with pytest.raises(ValueError, match="softmax-flex.*backward on CPU"):
        get_backend("softmax-flex")(q.requires_grad_(), k, v, lengths)


def test_softmax_flex_breaks_the_graph_at_its_block_mask_and_matches_eager():
    """The block mask is built eagerly even inside a compiled model (in the graph at a dynamic
    length inductor fails to lower it on CUDA): fullgraph=True refuses the backend, so the fast
    step compiles it with graph breaks, and that result is eager's on padded and unpadded
    batches. Here dynamo traces (backend eager; no backward: FlexAttention has none on CPU)."""
    from stabilitylab.attention import unpadded_hint

    flex = get_backend("softmax-flex")
    whole = torch.compile(lambda *a: flex(*a)[0], fullgraph=True, backend="eager")
    broken = torch.compile(lambda *a: flex(*a)[0], backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        q, k, v, lengths = _inputs(2, 2, 128, 64, [128, 77], torch.float32, 1)
        with pytest.raises(torch._dynamo.exc.Unsupported):
            whole(q, k, v, lengths)
        for lengths_list, unpadded in (([128, 77], False), ([128, 128], True)):
            q, k, v, lengths = _inputs(2, 2, 128, 64, lengths_list, torch.float32, 1)
            with unpadded_hint(unpadded):
                out_BHTD = broken(q, k, v, lengths)
            torch.testing.assert_close(out_BHTD, flex(q, k, v, lengths)[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["softmax", "softmax-reference", "sigmoid-reference"])
def test_two_key_biases_or_a_wrong_shape_are_refused_by_name(name):
    q, k, v, lengths = _inputs(2, 2, 8, 16, [8, 5], torch.float32, 0)
    backend = get_backend(name)
    with pytest.raises(ValueError, match="key_bias_BT or key_bias_BHT"):
        backend(q, k, v, lengths, key_bias_BT=torch.zeros(2, 8), key_bias_BHT=torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match=r"key_bias_BT must have shape \(2, 8\)"):
        backend(q, k, v, lengths, key_bias_BT=torch.zeros(2, 7))
    with pytest.raises(ValueError, match=r"key_bias_BHT must have shape \(2, 2, 8\)"):
        backend(q, k, v, lengths, key_bias_BHT=torch.zeros(2, 8))


def test_sdpa_mask_kinds():
    """SDPA gets no mask when nothing is padded (its is_causal / unmasked kernels), a boolean
    mask without a bias, an additive float mask with one."""
    from stabilitylab.attention import sdpa_mask

    full, padded = torch.tensor([6, 6]), torch.tensor([6, 4])
    bias = torch.zeros(2, 1, 1, 6)
    assert sdpa_mask(full, 6, True, None, torch.float32) is None
    assert sdpa_mask(full, 6, False, None, torch.float32) is None
    assert sdpa_mask(padded, 6, True, None, torch.float32).dtype == torch.bool
    m = sdpa_mask(padded, 6, True, bias, torch.float32)
    assert m.dtype == torch.float32 and m.shape == (2, 1, 6, 6)
    assert torch.isneginf(m[0, 0, 2, 3]) and m[0, 0, 3, 2] == 0 and torch.isneginf(m[1, 0, 5, 4])


@pytest.mark.parametrize("name", PADDING_BACKENDS)
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
    "name",
    ["softmax", *(pytest.param(n, marks=pytest.mark.interpreter)
                  for n in ("sigmoid-triton", "softmax-triton"))],
)  # fmt: skip
def test_backends_run_under_inference_mode(name, monkeypatch):
    """Inference tensors carry no version counter: the lengths caches must not ask for one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # sigmoid-triton on CPU: the interpreter
    with torch.inference_mode():
        q, k, v, lengths = _inputs(2, 2, 16, 64, [16, 9], torch.float32, 3)
        out, _ = get_backend(name)(q, k, v, lengths)
        out2, _ = get_backend(name)(q, k, v, lengths)
    ref = softmax_reference_f64 if name.startswith("softmax") else sigmoid_reference_f64
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
    from stabilitylab.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=256, n_heads=4, d_ff=1024, dropout=0.0)
    eager = Transformer(cfg, 300, 640, "sigmoid-triton").cuda()
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


def test_sdpa_kernel_choice_names_what_the_dispatcher_picks(monkeypatch):
    """The provenance record of the SDPA kernel: the dispatcher's number by name, the mask the
    softmax backend would pass (none when unpadded), and 'unknown' without the private hook."""
    from stabilitylab import attention

    seen = []

    def fake_choice(q, k, v, mask, dropout_p, is_causal):
        seen.append((mask is None, is_causal))
        return 3 if mask is None else 2

    monkeypatch.setattr(torch, "_fused_sdp_choice", fake_choice, raising=False)
    got = attention.sdpa_kernels(2, 3, 16, 8, torch.float32, "cpu", causal=True)
    assert got == {"unpadded": "cudnn", "padded": "efficient"}
    assert seen == [(True, True), (False, False)]  # causal goes in the mask once padded
    # A gated model's layers add a key bias: the additive mask, padded or not, is a form too.
    seen.clear()
    got = attention.sdpa_kernels(2, 3, 16, 8, torch.float32, "cpu", causal=False, key_bias=True)
    assert got == {"unpadded": "cudnn", "padded": "efficient",
                   "unpadded, key bias": "efficient", "padded, key bias": "efficient"}  # fmt: skip
    assert seen == [(True, False), (False, False), (False, False), (False, False)]
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    assert attention.sdpa_kernels(1, 1, 8, 8, torch.float32, "cpu", causal=False) == {
        "unpadded": "unknown",
        "padded": "unknown",
    }
