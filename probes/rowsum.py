"""Row-sum coefficient of variation: how freely an attention row's total mass varies by query.

For one (sequence, head) with valid query positions ``i < L``, ``n_i`` keys visible to query i
(``i + 1`` under the causal mask, ``L`` without it)::

    r_i = sum_{j visible to i} a_ij                       the row sum
    m_i = the row sum at equal logits, up to a factor fixed per sequence:
          softmax 1;  sigmoid n_i  (every weight sigmoid(b), b = -log L fixed per sequence)
    CV_raw  = std_i(r_i)       / mean_i(r_i)
    CV_norm = std_i(r_i / m_i) / mean_i(r_i / m_i)        population std (divide by L)

``CV_raw`` is the paper's statistic as written. Under the lab's ``b = -log L`` on every causal row
(``masked_attention``) it is confounded by row length: with equal logits ``r_i = (i + 1)
sigmoid(b)``, so attention that prefers no key gives ``CV_raw = sqrt((L - 1) / (3 (L + 1)))``
(0.576 at L = 512, 1/sqrt(3) as L grows). ``CV_norm``, the headline, divides that out: for a
sigmoid row ``r_i / n_i`` is the mean weight per visible key (the CV does not see the constant
factor), and equal logits give 0. A softmax row sums to 1 whatever its length, so its ``m_i`` is
1: both CVs are 0 for softmax by construction (float rounding aside). Without the causal mask
``n_i = L`` on every row and the two CVs agree.

Confirmed by the paper: the CV is taken across query positions, and is 0 for softmax. Inferred:
one CV per (sequence, layer, head), then averaged; the visibility rule (padding, causal mask) is
that of ``masked_attention``. A sequence of one token has CV 0. A (sequence, head) whose rows all
have zero mass gives NaN (0/0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
import torch

from stabilitylab.probes.masked_attention import attention_weights_BHTT, check_kind

STATISTICS = ("norm", "raw")
"""The two CVs of the module doc, headline first; table columns ``row_sum_cv_<statistic>``."""


def row_sum_cv_BH(
    a_BHTT: torch.Tensor, lengths_B: torch.Tensor, m_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """CV of ``r_i / m_i`` over valid queries, per (sequence, head): ``cv_BH``.

    ``a_BHTT`` holds weights with zeros where a pair is not visible (as
    ``attention_weights_BHTT`` returns them); padded query rows are left out here. ``m_BT``:
    the divisor of each row (``row_mass_BT``); None gives ``CV_raw``.
    """
    if a_BHTT.dim() != 4 or a_BHTT.shape[-1] != a_BHTT.shape[-2]:
        raise ValueError(f"a_BHTT must have shape (B, H, T, T), got {tuple(a_BHTT.shape)}")
    B, H, T, _ = a_BHTT.shape
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths_B shape {tuple(lengths_B.shape)} != ({B},)")
    if m_BT is not None and m_BT.shape != (B, T):
        raise ValueError(f"m_BT shape {tuple(m_BT.shape)} != {(B, T)}")
    valid_B1T = (torch.arange(T, device=lengths_B.device)[None, :] < lengths_B[:, None])[:, None]
    n_B1 = lengths_B.to(a_BHTT.dtype)[:, None]
    r_BHT = a_BHTT.sum(dim=-1)
    if m_BT is not None:
        r_BHT = r_BHT / m_BT.to(a_BHTT.dtype)[:, None, :]
    r_BHT = r_BHT * valid_B1T
    mean_BH = r_BHT.sum(dim=-1) / n_B1
    var_BH = ((r_BHT - mean_BH[..., None]) ** 2 * valid_B1T).sum(dim=-1) / n_B1
    return var_BH.sqrt() / mean_BH


def row_mass_BT(lengths_B: torch.Tensor, T: int, *, kind: str, causal: bool) -> torch.Tensor:
    """``m_BT`` of the module doc, float64: 1 for softmax; for sigmoid the keys visible to each
    query, ``n_i = i + 1`` causal (``L`` without the mask). Padded rows get 1 (left out)."""
    check_kind(kind)
    if kind == "softmax":
        return torch.ones(lengths_B.shape[0], T, dtype=torch.float64, device=lengths_B.device)
    i_1T = torch.arange(T, device=lengths_B.device)[None, :]
    L_B1 = lengths_B[:, None]
    n_BT = (i_1T + 1).expand(len(lengths_B), T) if causal else L_B1.expand(-1, T)
    return torch.where(i_1T < L_B1, n_BT, torch.ones_like(n_BT)).to(torch.float64)


def row_sum_cvs_BH(
    a_BHTT: torch.Tensor, lengths_B: torch.Tensor, *, kind: str, causal: bool
) -> dict[str, torch.Tensor]:
    """``{"norm": cv_BH, "raw": cv_BH}``: both CVs of the module doc for one layer's weights."""
    m_BT = row_mass_BT(lengths_B, a_BHTT.shape[-1], kind=kind, causal=causal)
    return {"norm": row_sum_cv_BH(a_BHTT, lengths_B, m_BT), "raw": row_sum_cv_BH(a_BHTT, lengths_B)}


def row_sum_cvs_from_qk_BH(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    kind: str,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    sigmoid_bias: float | None = None,
    scale: float | None = None,
) -> dict[str, torch.Tensor]:
    """``row_sum_cvs_BH`` of the weights of ``attention_weights_BHTT`` (same arguments)."""
    a_BHTT = attention_weights_BHTT(
        q_BHTD,
        k_BHTD,
        lengths_B,
        kind=kind,
        causal=causal,
        key_bias_BT=key_bias_BT,
        sigmoid_bias=sigmoid_bias,
        scale=scale,
    )
    return row_sum_cvs_BH(a_BHTT, lengths_B, kind=kind, causal=causal)


def _flat(cvs: torch.Tensor | Sequence[torch.Tensor], what: str) -> torch.Tensor:
    cvs = [cvs] if isinstance(cvs, torch.Tensor) else list(cvs)
    flat = torch.cat([torch.as_tensor(c).flatten() for c in cvs]).double() if cvs else None
    if flat is None or flat.numel() == 0:
        raise ValueError(f"no row-sum CVs for {what}")
    return flat


def row_sum_cv_table(
    cv_by_statistic: Mapping[str, Mapping[int, torch.Tensor | Sequence[torch.Tensor]]],
) -> pd.DataFrame:
    """Tidy table, one row per layer: ``layer``, then ``row_sum_cv_<s>, row_sum_cv_<s>_std``
    for each statistic ``s`` given (``STATISTICS`` order first), then ``n``.

    ``cv_by_statistic[s][layer]`` is one ``cv_BH`` or a list of them (one per batch);
    ``row_sum_cv_<s>`` is their mean over every (sequence, head), NaN kept; ``_std`` their
    population spread; ``n`` their count (the same for every statistic of a layer).
    """
    stats = [s for s in STATISTICS if s in cv_by_statistic]
    stats += sorted(s for s in cv_by_statistic if s not in STATISTICS)
    if not stats:
        raise ValueError("row_sum_cv_table needs at least one statistic")
    layers = sorted(cv_by_statistic[stats[0]])
    rows = []
    for layer in layers:
        row: dict = {"layer": int(layer)}
        counts = set()
        for s in stats:
            if layer not in cv_by_statistic[s]:
                raise ValueError(f"no row-sum CVs for layer {layer}, statistic {s!r}")
            flat = _flat(cv_by_statistic[s][layer], f"layer {layer}, statistic {s!r}")
            row[f"row_sum_cv_{s}"] = float(flat.mean())
            row[f"row_sum_cv_{s}_std"] = float(flat.std(correction=0))
            counts.add(flat.numel())
        if len(counts) != 1:
            raise ValueError(f"layer {layer}: the statistics count different CVs {sorted(counts)}")
        rows.append({**row, "n": counts.pop()})
    columns = ["layer", *(f"row_sum_cv_{s}{x}" for s in stats for x in ("", "_std")), "n"]
    return pd.DataFrame(rows, columns=columns)
