"""Jacobian maths for the probes: score maps, a toy attention layer, exact and estimated norms.

Everything here is a pure function of its tensor arguments; nothing touches the global RNG (the
power iteration draws its start vector from its own ``torch.Generator``).

Score maps (one row of attention scores ``s_N``, ``n = N``)::

    softmax:  p = softmax(s),      dp/ds = diag(p) - p p^T               (dense, rank n-1)
    sigmoid:  p = sigmoid(s + b),  dp/ds = diag(p (1 - p)),  b = -log n  (diagonal, <= 1/4)

Toy attention layer (one sequence ``x_NC``, one head of width ``D``)::

    q = x W_Q, k = x W_K, v = x W_V          (optionally q, k <- LayerNorm(q), LayerNorm(k))
    y = P(q k^T / sqrt(D)) v,   P = row softmax, or elementwise sigmoid(. + b), b = -log N

The Jacobian of ``x_NC -> y_ND`` is a ``(N*D, N*C)`` matrix; its spectral norm is the local
Lipschitz constant of the layer at ``x`` (Euclidean norms on the flattened tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("softmax", "sigmoid")
LN_EPS = 1e-5


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {KINDS}")


def default_sigmoid_bias(n: int) -> float:
    """``b = -log n``: keeps the sum of sigmoid weights near 1 when scores are near 0."""
    if n < 1:
        raise ValueError(f"sequence length must be >= 1, got {n}")
    return -math.log(n)


# ---- score maps ----------------------------------------------------------------------------


def score_probs(s_N: torch.Tensor, kind: str, bias: float | None = None) -> torch.Tensor:
    """Attention weights of one or many score rows (last dim = keys): softmax or sigmoid(s + b)."""
    _check_kind(kind)
    if s_N.dim() < 1 or s_N.shape[-1] < 1:
        raise ValueError(f"scores need a non-empty last dimension, got shape {tuple(s_N.shape)}")
    if kind == "softmax":
        return torch.softmax(s_N, dim=-1)
    b = default_sigmoid_bias(s_N.shape[-1]) if bias is None else bias
    return torch.sigmoid(s_N + b)


def softmax_jacobian_closed_form(s_N: torch.Tensor) -> torch.Tensor:
    """``dp/ds = diag(p) - p p^T`` for ``p = softmax(s_N)``: an ``(N, N)`` matrix."""
    if s_N.dim() != 1:
        raise ValueError(f"expected one score row s_N, got shape {tuple(s_N.shape)}")
    p_N = torch.softmax(s_N, dim=-1)
    return torch.diag(p_N) - torch.outer(p_N, p_N)


def sigmoid_jacobian_closed_form(s_N: torch.Tensor, bias: float | None = None) -> torch.Tensor:
    """``dp/ds = diag(p (1 - p))`` for ``p = sigmoid(s_N + b)``: an ``(N, N)`` diagonal matrix."""
    if s_N.dim() != 1:
        raise ValueError(f"expected one score row s_N, got shape {tuple(s_N.shape)}")
    p_N = score_probs(s_N, "sigmoid", bias)
    return torch.diag(p_N * (1 - p_N))


# ---- toy attention layer -------------------------------------------------------------------


@dataclass(frozen=True)
class ToyWeights:
    """Projections of the toy layer, ``(C, D)`` each, entries ``N(0, 1/C)``."""

    w_q_CD: torch.Tensor
    w_k_CD: torch.Tensor
    w_v_CD: torch.Tensor


def toy_weights(
    dim: int, head_dim: int, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> ToyWeights:
    """Random projections with variance ``1/C``, so ``x W`` keeps the per-entry scale of ``x``."""
    if dim < 1 or head_dim < 1:
        raise ValueError(f"dim and head_dim must be >= 1, got dim={dim}, head_dim={head_dim}")
    std = 1.0 / math.sqrt(dim)
    w = [torch.randn(dim, head_dim, generator=generator, dtype=dtype) * std for _ in range(3)]
    return ToyWeights(*w)


def toy_attention(
    x_NC: torch.Tensor,
    weights: ToyWeights,
    kind: str,
    qk_layernorm: bool = False,
    bias: float | None = None,
) -> torch.Tensor:
    """``y_ND = P(q k^T / sqrt(D)) v`` for one sequence; see the module docstring."""
    _check_kind(kind)
    if x_NC.dim() != 2:
        raise ValueError(f"expected one sequence x_NC, got shape {tuple(x_NC.shape)}")
    if x_NC.shape[1] != weights.w_q_CD.shape[0]:
        raise ValueError(
            f"x_NC has C={x_NC.shape[1]} but the weights expect C={weights.w_q_CD.shape[0]}"
        )
    q_ND, k_ND, v_ND = x_NC @ weights.w_q_CD, x_NC @ weights.w_k_CD, x_NC @ weights.w_v_CD
    D = q_ND.shape[1]
    if qk_layernorm:
        q_ND = F.layer_norm(q_ND, (D,), eps=LN_EPS)
        k_ND = F.layer_norm(k_ND, (D,), eps=LN_EPS)
    s_NN = q_ND @ k_ND.T / math.sqrt(D)
    return score_probs(s_NN, kind, bias) @ v_ND


def max_abs_score(x_NC: torch.Tensor, weights: ToyWeights, qk_layernorm: bool = False) -> float:
    """``max |q_i . k_j| / sqrt(D)`` of the toy layer: the score magnitude an input produces."""
    q_ND, k_ND = x_NC @ weights.w_q_CD, x_NC @ weights.w_k_CD
    D = q_ND.shape[1]
    if qk_layernorm:
        q_ND = F.layer_norm(q_ND, (D,), eps=LN_EPS)
        k_ND = F.layer_norm(k_ND, (D,), eps=LN_EPS)
    return float((q_ND @ k_ND.T).abs().max() / math.sqrt(D))


# ---- Jacobians and their norms -------------------------------------------------------------


def exact_jacobian(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Full Jacobian of ``fn`` at ``x`` by reverse-mode autograd, flattened to ``(out, in)``."""
    y = fn(x)
    J = torch.func.jacrev(fn)(x)
    return J.reshape(y.numel(), x.numel())


def spectral_norm(J_MN: torch.Tensor) -> float:
    """Largest singular value of a matrix, ``sqrt(lambda_max(G))`` of the smaller Gram matrix ``G``.

    A symmetric eigensolve of the Gram matrix is several times faster than an SVD at the toy
    sizes used here (1024 x 1024), and the top eigenvalue keeps full relative accuracy.
    """
    if J_MN.dim() != 2:
        raise ValueError(f"expected a matrix, got shape {tuple(J_MN.shape)}")
    J_MN = J_MN.detach()
    G = J_MN @ J_MN.T if J_MN.shape[0] <= J_MN.shape[1] else J_MN.T @ J_MN
    return math.sqrt(max(float(torch.linalg.eigvalsh(G)[-1]), 0.0))


def max_offdiag_abs(J_NN: torch.Tensor) -> float:
    """``max_{i != j} |J_ij|``: exactly 0 for a diagonal Jacobian."""
    if J_NN.dim() != 2 or J_NN.shape[0] != J_NN.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(J_NN.shape)}")
    eye = torch.eye(J_NN.shape[0], dtype=torch.bool, device=J_NN.device)
    return float(J_NN.masked_fill(eye, 0).abs().max())


@dataclass(frozen=True)
class PowerIterationResult:
    sigma: float
    """Estimate of the largest singular value (a lower bound that rises to it)."""
    iters: int
    """Iterations run (fewer than asked when ``tol`` was met)."""
    history: tuple[float, ...] = ()
    """The estimate after each iteration (non-decreasing up to rounding)."""


def power_iteration_spectral_norm(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    iters: int = 20,
    tol: float = 0.0,
    generator: torch.Generator | None = None,
    seed: int = 0,
) -> PowerIterationResult:
    """Spectral norm of ``J = d fn / dx`` at ``x`` without forming ``J``.

    Iterates ``v <- J^T J v / ||J^T J v||`` with one JVP (``u = J v``) and one VJP
    (``w = J^T u``) per step; the estimate is ``sqrt(||J^T J v||)`` for unit ``v``, which by
    Cauchy-Schwarz lies between ``||J v||`` and ``sigma_max``. Stops early once the relative change
    of the estimate is below ``tol``.

    The JVP is the VJP of the (linear) VJP map, ``J v = d/dw <J^T w, v>`` (double backward): both
    products then replay graphs recorded once, instead of a forward-mode pass per step, which
    costs ~10x a forward in ``torch.func.jvp`` on small CPU inputs and which fused attention kernels
    lack. ``fn`` must therefore be twice differentiable (fused kernels are not: use their math
    path). The start vector comes from ``generator`` (or a fresh CPU generator seeded with
    ``seed``), never from the global RNG. Gradients flow to ``x`` only: no ``.grad`` is written.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if x.numel() == 0:
        raise ValueError("x is empty")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    v = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=generator.device)
    v = (v / v.norm()).to(x.device)
    y, vjp_fn = torch.func.vjp(fn, x.detach())
    _, jvp_fn = torch.func.vjp(lambda w: vjp_fn(w)[0], torch.zeros_like(y))
    history: list[float] = []
    for _ in range(iters):
        # detach: when fn closes over tensors that require grad, no graph grows across steps.
        (u,) = jvp_fn(v)
        (w,) = vjp_fn(u.detach())
        w = w.detach()
        w_norm = float(w.norm())
        if w_norm == 0.0:
            # v lies in the null space; with a random start that means J = 0 (to rounding).
            history.append(0.0)
            break
        history.append(math.sqrt(w_norm))
        v = w / w_norm
        if tol > 0 and len(history) > 1 and abs(history[-1] - history[-2]) <= tol * history[-1]:
            break
    return PowerIterationResult(history[-1], len(history), tuple(history))


def loglog_slope(x: list[float] | torch.Tensor, y: list[float] | torch.Tensor) -> float:
    """Least-squares slope of ``log y`` on ``log x``: the exponent ``a`` in ``y ~ x^a``."""
    x_t = torch.as_tensor(x, dtype=torch.float64)
    y_t = torch.as_tensor(y, dtype=torch.float64)
    if x_t.shape != y_t.shape or x_t.numel() < 2:
        raise ValueError(
            f"need two equal-length series of >= 2 points, got {x_t.shape}, {y_t.shape}"
        )
    if bool((x_t <= 0).any() | (y_t <= 0).any()):
        raise ValueError("log-log slope needs positive values")
    lx, ly = x_t.log(), y_t.log()
    lx_c = lx - lx.mean()
    return float((lx_c * (ly - ly.mean())).sum() / (lx_c * lx_c).sum())
