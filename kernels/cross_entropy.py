"""Cross-entropy and its logit gradient per row in one Triton kernel, for the chunked loss.

For logits ``x_RP`` (R rows, P >= V columns, the first V real, the rest the head's padding) and
labels ``y_R``, one program per row computes

    lse_r = log sum_{j < V} exp(x_rj),   loss_r = lse_r - x_{r, y_r},
    g_rj = exp(x_rj - lse_r) - [j == y_r] for j < V,   g_rj = 0 for V <= j < P,

in float32, reading the row twice (an online max and sum, then the gradient) and writing g in the
logits' dtype, in place over the logits when asked. The eager chunk (``stabilitylab.chunked_loss``)
casts the logits to float32 and runs about eight kernels over them; this is the same function,
its sums in another order. A NaN or infinite logit makes the row's loss NaN (eager: NaN or +inf),
so a diverging run still shows. The maths: ``cross_entropy_grad_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.triton_support import compiled, interpreted, interpreting

# Columns per step of a row's loop: 4,096 16-bit values (8 KB) per step on 8 warps.
BLOCK_COLS = 4096
NUM_WARPS = 8
INTERPRETER_BLOCK_COLS = 16


def cross_entropy_grad_reference(logits_RP: torch.Tensor, y_R: torch.Tensor, V: int):
    """``(loss_R, g_RP)``: the kernel's maths in float32 torch ops, g in the logits' dtype; the
    logits are not changed (float32 ones are copied too)."""
    x = logits_RP.to(torch.float32, copy=True)
    x[:, V:] = float("-inf")
    lse_R = torch.logsumexp(x, dim=-1)
    loss_R = lse_R - x.gather(1, y_R[:, None].long())[:, 0]
    g = x.sub_(lse_R[:, None]).exp_()  # softmax, in place on the copy
    g.scatter_add_(1, y_R[:, None].long(), torch.full_like(g[:, :1], -1.0))
    return loss_R, g.to(logits_RP.dtype)


@triton.jit
def _ce_grad_kernel(
    X, Y, G, LOSS, V, P, sxr, sgr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_base = X + row * sxr
    g_base = G + row * sgr
    offs = tl.arange(0, BLOCK)
    # A finite floor for the running max: a masked (-inf) lane adds exp(-inf - floor) = 0, never
    # exp(-inf - -inf) = NaN.
    m = tl.full((BLOCK,), -1e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(x_base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    m_row = tl.max(m, 0)  # a NaN lane has a NaN sum too: the row stays NaN
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), 0))
    y = tl.load(Y + row)
    tl.store(LOSS + row, lse - tl.load(x_base + y).to(tl.float32))
    for start in range(0, P, BLOCK):
        cols = start + offs
        x = tl.load(x_base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        g = tl.exp(x - lse)
        g = tl.where(cols == y, g - 1.0, g)
        tl.store(g_base + cols, g.to(G.dtype.element_ty), mask=cols < P)


def cross_entropy_grad(
    logits_RP: torch.Tensor, y_R: torch.Tensor, V: int, *, in_place: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_R float32, g_RP)`` (module docstring) for 2-D logits with unit column stride and
    labels in [0, V) (not checked: that would sync the host). ``in_place``: g overwrites the
    logits (each value is read before it is written, by the same program)."""
    if logits_RP.dim() != 2 or logits_RP.stride(1) != 1:
        raise ValueError(f"logits_RP must be 2-D with unit column stride, got {logits_RP.shape}")
    R, P = logits_RP.shape
    if not 1 <= V <= P:
        raise ValueError(f"V must lie in [1, {P}] (the logits' columns), got {V}")
    if y_R.shape != (R,):
        raise ValueError(f"y_R must have shape ({R},), got {tuple(y_R.shape)}")
    if y_R.device != logits_RP.device:
        raise ValueError(f"y_R is on {y_R.device}, the logits on {logits_RP.device}")
    g_RP = logits_RP if in_place else torch.empty_like(logits_RP)
    loss_R = torch.empty(R, dtype=torch.float32, device=logits_RP.device)
    if R == 0:
        return loss_R, g_RP
    args = (logits_RP, y_R, g_RP, loss_R, V, P, logits_RP.stride(0), g_RP.stride(0))
    if interpreting():
        interpreted(_ce_grad_kernel)[(R,)](*args, BLOCK=INTERPRETER_BLOCK_COLS)
    else:
        compiled(_ce_grad_kernel)[(R,)](*args, BLOCK=BLOCK_COLS, num_warps=NUM_WARPS)
    return loss_R, g_RP
