"""The chunked loss's Triton kernel (``kernels/cross_entropy.py``) against its torch reference,
and the chunked loss through it against the chunked loss in torch ops. CPU: Triton's interpreter
(float32 and float16; its bf16 is unreliable); CUDA: the compiled kernel in bf16."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from stabilitylab import chunked_loss
from stabilitylab.chunked_loss import linear_cross_entropy_sum

ce = importlib.import_module("stabilitylab.kernels.cross_entropy")

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.interpreter),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="CUDA")]),
]


def _logits(R, P, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, P, generator=g) * 4).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R, P, V", [(7, 53, 50), (3, 64, 64), (1, 20, 1), (5, 4100, 4099)])
def test_kernel_matches_the_reference(device, R, P, V):
    """Loss and gradient per row, pad columns (V <= j < P) at gradient 0, the label's column at
    p - 1; rows of more than one loop step (P > the block) on the GPU."""
    dtypes = (torch.float32, torch.float16) if device == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        x = _logits(R, P, dtype, device)
        y = torch.randint(0, V, (R,), generator=torch.Generator().manual_seed(1)).to(device)
        loss, g = ce.cross_entropy_grad(x, y, V)
        loss_ref, g_ref = ce.cross_entropy_grad_reference(x, y, V)
        assert g.dtype == dtype and loss.dtype == torch.float32
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(g.float(), g_ref.float(), rtol=tol, atol=tol)
        assert (g[:, V:] == 0).all()
        assert (g.float().sum(1).abs() < 1e-2).all()  # softmax - one-hot sums to zero


@pytest.mark.interpreter
def test_in_place_writes_the_gradient_over_the_logits():
    x = _logits(4, 30, torch.float32, "cpu")
    y = torch.tensor([0, 5, 29, 3])
    _, g_ref = ce.cross_entropy_grad_reference(x, y, 30)
    loss, g = ce.cross_entropy_grad(x, y, 30, in_place=True)
    assert g.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, g_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.interpreter
def test_a_nan_or_infinite_logit_makes_its_row_non_finite():
    """A diverging run must still show in the loss: the row with a NaN or an inf logit."""
    x = _logits(3, 40, torch.float32, "cpu")
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    loss, _ = ce.cross_entropy_grad(x, torch.tensor([0, 1, 2]), 37)
    assert loss[0].isfinite() and not loss[1].isfinite() and not loss[2].isfinite()


def test_bad_arguments_name_the_problem():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="V must lie in"):
        ce.cross_entropy_grad(x, torch.zeros(3, dtype=torch.long), 9)
    with pytest.raises(ValueError, match="y_R must have shape"):
        ce.cross_entropy_grad(x, torch.zeros(4, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="unit column stride"):
        ce.cross_entropy_grad(x.t(), torch.zeros(8, dtype=torch.long), 3)


@pytest.mark.interpreter
@pytest.mark.parametrize("row_multiple", [1, 16])
def test_the_chunked_loss_through_the_kernel_equals_it_in_torch_ops(row_multiple, monkeypatch):
    """Loss and the gradients of h, the weight and the bias, several chunks, the head padded."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 24, 16, generator=g).requires_grad_()
    w = (torch.randn(37, 16, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(37, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, 37, (2, 24), generator=g)
    labels = torch.where(torch.rand(2, 24, generator=g) < 0.4, labels, -100)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(chunked_loss, "fused_chunks", lambda device, on=fused: on)
        loss = linear_cross_entropy_sum(
            h, w, b, labels, max_chunk_elements=5 * 48, row_multiple=row_multiple
        )
        results.append((loss.detach(), *torch.autograd.grad(loss * 0.37, (h, w, b))))
    for torch_ops, kernel in zip(*results, strict=True):
        torch.testing.assert_close(kernel, torch_ops, rtol=1e-5, atol=1e-6)
    eager = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(results[1][0], eager.detach(), rtol=1e-5, atol=1e-5)


def test_the_reference_leaves_its_logits_alone():
    x = _logits(2, 10, torch.float32, "cpu")
    before = x.clone()
    ce.cross_entropy_grad_reference(x, torch.tensor([1, 2]), 7)
    assert torch.equal(x, before)
