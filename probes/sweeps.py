"""Sweeps behind the probe scripts: each returns a tidy DataFrame, one row per measurement.

All inputs are drawn in float64 from a generator seeded by the caller, so every table is
reproducible and the global RNG is left alone. Sizes are toy sizes: exact Jacobians by autograd.
"""

from __future__ import annotations

import itertools

import pandas as pd
import torch

from stabilitylab.probes.jacobian import (
    KINDS,
    exact_jacobian,
    loglog_slope,
    max_abs_score,
    max_offdiag_abs,
    power_iteration_spectral_norm,
    score_probs,
    sigmoid_jacobian_closed_form,
    softmax_jacobian_closed_form,
    spectral_norm,
    toy_attention,
    toy_weights,
)

DTYPE = torch.float64


def score_map_table(ns: list[int], scales: list[float], rows: int, seed: int = 0) -> pd.DataFrame:
    """Exact Jacobians of the softmax and sigmoid score maps on rows ``s = scale * z``, z ~ N(0, 1).

    Columns: kind, n, scale, row, sigma (spectral norm), max_entry (max |J_ij|), max_offdiag,
    closed_form_err (max |J - closed form|), max_abs_score.
    """
    if rows < 1 or not ns or not scales:
        raise ValueError(f"need rows >= 1 and non-empty ns, scales; got {rows}, {ns}, {scales}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, scale, row in itertools.product(ns, scales, range(rows)):
        s_N = torch.randn(n, generator=gen, dtype=DTYPE) * scale
        for kind in KINDS:
            J_NN = exact_jacobian(lambda s, kind=kind: score_probs(s, kind), s_N)
            closed = (
                softmax_jacobian_closed_form(s_N)
                if kind == "softmax"
                else sigmoid_jacobian_closed_form(s_N)
            )
            out.append(
                dict(
                    kind=kind,
                    n=n,
                    scale=scale,
                    row=row,
                    sigma=spectral_norm(J_NN),
                    max_entry=float(J_NN.abs().max()),
                    max_offdiag=max_offdiag_abs(J_NN),
                    closed_form_err=float((J_NN - closed).abs().max()),
                    max_abs_score=float(s_N.abs().max()),
                )
            )
    return pd.DataFrame(out)


def score_map_summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (kind, n, scale) of ``score_map_table``: median and max spectral norm, the
    largest entry, off-diagonal entry and closed-form error, the median max |score|."""
    return (
        df.groupby(["kind", "n", "scale"])
        .agg(
            sigma_median=("sigma", "median"),
            sigma_max=("sigma", "max"),
            max_entry=("max_entry", "max"),
            max_offdiag=("max_offdiag", "max"),
            closed_form_err=("closed_form_err", "max"),
            max_abs_score=("max_abs_score", "median"),
        )
        .reset_index()
    )


def _layer_rows(n: int, scale: float, dim: int, head_dim: int, gen: torch.Generator) -> list[dict]:
    """One draw of (x, W) at one (n, scale): the four variants share the same x and W."""
    w = toy_weights(dim, head_dim, gen)
    x_NC = torch.randn(n, dim, generator=gen, dtype=DTYPE) * scale
    rows = []
    for kind, qk_ln in itertools.product(KINDS, (False, True)):
        J = exact_jacobian(lambda x, k=kind, ln=qk_ln: toy_attention(x, w, k, ln), x_NC)
        rows.append(
            dict(
                kind=kind,
                qk_ln=qk_ln,
                n=n,
                scale=scale,
                sigma=spectral_norm(J),
                max_abs_score=max_abs_score(x_NC, w, qk_ln),
                mean_sq_norm=float((x_NC * x_NC).sum(dim=1).mean()),
            )
        )
    return rows


def layer_table(
    ns: list[int],
    scales: list[float],
    dim: int = 16,
    head_dim: int = 16,
    draws: int = 4,
    seed: int = 0,
) -> pd.DataFrame:
    """Exact spectral norm of the toy layer's Jacobian d y_ND / d x_NC over a grid of (n, scale).

    ``x = scale * z``, z ~ N(0, 1), so ``||x_i||^2 ~ scale^2 C`` and (QK-LN off) the scores grow
    like ``scale^2``. Columns: kind, qk_ln, n, scale, draw, sigma, max_abs_score, mean_sq_norm.
    """
    if draws < 1 or not ns or not scales:
        raise ValueError(f"need draws >= 1 and non-empty ns, scales; got {draws}, {ns}, {scales}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, scale, draw in itertools.product(ns, scales, range(draws)):
        for row in _layer_rows(n, scale, dim, head_dim, gen):
            out.append(dict(row, draw=draw))
    return pd.DataFrame(out)


def estimator_table(
    cases: list[tuple[str, bool, int, float]],
    iters: list[int],
    dim: int = 16,
    head_dim: int = 16,
    tol: float = 0.0,
    seed: int = 0,
) -> pd.DataFrame:
    """Power iteration vs the exact spectral norm on toy layers; cases are (kind, qk_ln, n, scale).

    Columns: kind, qk_ln, n, scale, iters_asked, iters_run, exact, estimate, rel_err.
    """
    if not iters or min(iters) < 1:
        raise ValueError(f"iters must be a non-empty list of counts >= 1, got {iters}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for kind, qk_ln, n, scale in cases:
        w = toy_weights(dim, head_dim, gen)
        x_NC = torch.randn(n, dim, generator=gen, dtype=DTYPE) * scale
        fn = lambda x, k=kind, ln=qk_ln, w=w: toy_attention(x, w, k, ln)
        exact = spectral_norm(exact_jacobian(fn, x_NC))
        # One run: the estimate after k iterations does not depend on how many follow.
        run = power_iteration_spectral_norm(fn, x_NC, iters=max(iters), tol=tol, seed=seed)
        for it in iters:
            estimate = run.history[min(it, run.iters) - 1]
            out.append(
                dict(
                    kind=kind,
                    qk_ln=qk_ln,
                    n=n,
                    scale=scale,
                    iters_asked=it,
                    iters_run=min(it, run.iters),
                    exact=exact,
                    estimate=estimate,
                    rel_err=abs(estimate - exact) / exact,
                )
            )
    return pd.DataFrame(out)


def median_curve(df: pd.DataFrame, x: str) -> pd.DataFrame:
    """Median over draws of sigma (and of the score size) per (kind, qk_ln, x)."""
    return (
        df.groupby(["kind", "qk_ln", x])
        .agg(
            sigma=("sigma", "median"),
            sigma_min=("sigma", "min"),
            sigma_max=("sigma", "max"),
            max_abs_score=("max_abs_score", "median"),
            mean_sq_norm=("mean_sq_norm", "median"),
        )
        .reset_index()
    )


def slope_table(curve: pd.DataFrame, x: str, ranges: list[tuple[float, float]]) -> pd.DataFrame:
    """Log-log slope of the median sigma against ``x`` on each closed range ``[lo, hi]``.

    Columns: kind, qk_ln, lo, hi, points, slope (``sigma ~ x^slope`` there), ratio (sigma at hi
    over sigma at lo).
    """
    out = []
    for (kind, qk_ln), g in curve.groupby(["kind", "qk_ln"]):
        for lo, hi in ranges:
            part = g[(g[x] >= lo * (1 - 1e-9)) & (g[x] <= hi * (1 + 1e-9))].sort_values(x)
            if len(part) < 2:
                raise ValueError(f"range [{lo}, {hi}] of {x} holds fewer than 2 points")
            out.append(
                dict(
                    kind=kind,
                    qk_ln=qk_ln,
                    lo=lo,
                    hi=hi,
                    points=len(part),
                    slope=loglog_slope(part[x].tolist(), part.sigma.tolist()),
                    ratio=float(part.sigma.iloc[-1] / part.sigma.iloc[0]),
                )
            )
    return pd.DataFrame(out)
