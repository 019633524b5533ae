"""Row-sum coefficient of variation: how freely an attention row's total mass varies by query.

For one (sequence, head) with valid query positions ``i < L``::

    r_i = sum_{j visible to i} a_ij
    CV  = std_i(r_i) / mean_i(r_i)        population std (divide by L), over valid queries

Confirmed by the paper: the CV is taken across query positions, and is 0 for softmax by
construction (every row sums to 1). Inferred: one CV per (sequence, layer, head), then averaged;
the visibility rule (padding, causal mask) is that of ``masked_attention``. A sequence of one
token has CV 0. A (sequence, head) whose rows all have zero mass gives NaN (0/0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
import torch

from stabilitylab.probes.masked_attention import attention_weights_BHTT


def row_sum_cv_BH(a_BHTT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """CV of the row sums over valid queries, per (sequence, head): ``cv_BH``.

    ``a_BHTT`` holds weights with zeros where a pair is not visible (as
    ``attention_weights_BHTT`` returns them); padded query rows are left out here.
    """
    if a_BHTT.dim() != 4 or a_BHTT.shape[-1] != a_BHTT.shape[-2]:
        raise ValueError(f"a_BHTT must have shape (B, H, T, T), got {tuple(a_BHTT.shape)}")
    B, H, T, _ = a_BHTT.shape
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths_B shape {tuple(lengths_B.shape)} != ({B},)")
    valid_B1T = (torch.arange(T, device=lengths_B.device)[None, :] < lengths_B[:, None])[:, None]
    n_B1 = lengths_B.to(a_BHTT.dtype)[:, None]
    r_BHT = a_BHTT.sum(dim=-1) * valid_B1T
    mean_BH = r_BHT.sum(dim=-1) / n_B1
    var_BH = ((r_BHT - mean_BH[..., None]) ** 2 * valid_B1T).sum(dim=-1) / n_B1
    return var_BH.sqrt() / mean_BH


def row_sum_cv_from_qk_BH(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    kind: str,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    sigmoid_bias: float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``row_sum_cv_BH`` of the weights of ``attention_weights_BHTT`` (same arguments)."""
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
    return row_sum_cv_BH(a_BHTT, lengths_B)


def row_sum_cv_table(
    cv_by_layer: Mapping[int, torch.Tensor | Sequence[torch.Tensor]],
) -> pd.DataFrame:
    """Tidy table, one row per layer: ``layer, row_sum_cv, std, n``.

    ``row_sum_cv`` is the mean over every (sequence, head) CV given for the layer (one
    ``cv_BH`` or a list of them, one per batch); ``std`` is their population spread.
    """
    rows = []
    for layer, cvs in sorted(cv_by_layer.items()):
        cvs = [cvs] if isinstance(cvs, torch.Tensor) else list(cvs)
        flat = torch.cat([torch.as_tensor(c).flatten() for c in cvs]).double()
        if flat.numel() == 0:
            raise ValueError(f"no row-sum CVs for layer {layer}")
        rows.append(
            dict(
                layer=int(layer),
                row_sum_cv=float(flat.mean()),
                std=float(flat.std(correction=0)),
                n=int(flat.numel()),
            )
        )
    return pd.DataFrame(rows, columns=["layer", "row_sum_cv", "std", "n"])
