"""The eviction study's probes on a trained decoder: support removal, row-sum CV, gates.

Each function takes a ``Transformer`` and a batch of token windows (``tokens_BT`` in the model's
own ids, right-padded, ``lengths_B`` valid tokens per row) and returns a tidy table. The model is
run in eval mode without gradients (its training flag is put back after); ``model.gates`` is left
holding the gates of the last chunk. ``batch_size`` splits the windows into chunks of that many
(the probe maths hold ``B x H x T x T`` weights); the tables do not depend on it.

Support removal (``support_removal_by_layer``; maths in ``probes/support_removal.py``): one random
mask per (sequence, layer), the first four positions kept, ``removal_masks_LBT`` drawn up front
from ``seed`` (so both protocols, and any ``batch_size``, use the same masks; one generator per p,
seeded alike, so the masks of a smaller p are subsets of a larger p's). The reference pass runs
every layer on the probe maths without removal (so p = 0 gives exactly 0); then

- ``isolated``: each layer's captured q, k, v with the layer's mask: a property of that layer;
- ``compound`` (the paper's): a second forward pass with each layer's mask applied at every layer
  at once, so a layer's q, k, v carry the upstream perturbation; each layer's attention output
  (before the output projection) is compared with the reference pass's.

Layer 0 sees no upstream perturbation, so there the two protocols agree exactly.

Row-sum CV (``row_sum_cv_by_layer``): from the backends' own inputs, weights in float64, the
gate's key bias included, both statistics of ``probes/rowsum.py``: ``row_sum_cv_norm`` (the
headline: row sums over the row's mass at equal logits, i.e. the mean weight per visible key under
sigmoid) and ``row_sum_cv_raw`` (the paper's as written, which the row length alone pushes
towards 0.577 under ``b = -log L``); softmax gives 0 in both up to float64 rounding. Gates
(``gate_binarization_by_layer``, ``gates_by_token_category``, ``extreme_gate_tokens``): ``layer``
is the block that emits the gate (``model.gates[layer]``, read by ``layer + 1``), the model's and
the trainer's numbering. Per-head gates count each (token, head) for binarization and are
averaged over heads for the categories.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from stabilitylab.model import inference
from stabilitylab.probes.gates import gate_stats_table, gate_sums
from stabilitylab.probes.model_capture import (
    AttentionInputs,
    attention_kind,
    capture_attention,
    layer_attention_BHTD,
    layer_weights_BHTT,
    swapped_attention,
)
from stabilitylab.probes.rowsum import row_sum_cv_table, row_sum_cvs_BH
from stabilitylab.probes.support_removal import (
    N_SINKS,
    relative_perturbation_B,
    removal_count,
    sample_removal_mask_BT,
    support_removal_table,
)
from stabilitylab.probes.token_categories import extreme_tokens, gate_by_category

PROTOCOLS = ("isolated", "compound")
GATE_COLUMNS = {
    "mean": "gate_mean",
    "frac_low": "frac_below_0.05",
    "frac_high": "frac_above_0.95",
    "frac_binary": "binarization",
}
PiecesFn = Callable[[Sequence[int]], Sequence[str | None]]
"""Model token ids -> their text pieces; None for a token the category tables leave out."""


# ---- batches and the model's mode -------------------------------------------------------------


def check_windows(model, tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> None:
    """One-line ``ValueError``s for windows the model cannot read, before any work."""
    if tokens_BT.dim() != 2 or tokens_BT.dtype != torch.long:
        shape = tuple(tokens_BT.shape)
        raise ValueError(f"tokens_BT must be a 2-d long tensor, got {shape} {tokens_BT.dtype}")
    B, T = tokens_BT.shape
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths_B shape {tuple(lengths_B.shape)} != ({B},)")
    if B == 0 or int(lengths_B.min()) < 1 or int(lengths_B.max()) > T:
        raise ValueError(f"lengths_B must lie in [1, T={T}], got {lengths_B.tolist()}")
    vocab = model.tok_emb.num_embeddings
    if int(tokens_BT.min()) < 0 or int(tokens_BT.max()) >= vocab:
        raise ValueError(
            f"tokens_BT holds ids outside the model's vocabulary [0, {vocab}): min "
            f"{int(tokens_BT.min())}, max {int(tokens_BT.max())} (compact ids expected?)"
        )


def _chunks(B: int, batch_size: int | None) -> list[slice]:
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    step = B if batch_size is None else batch_size
    return [slice(i, min(i + step, B)) for i in range(0, B, step)]


def _on_model(model, *tensors: torch.Tensor) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    return [t.to(device) for t in tensors]


def captured_attention(
    model, tokens_BT: torch.Tensor, lengths_B: torch.Tensor
) -> tuple[torch.Tensor, list[AttentionInputs]]:
    """One forward pass under ``capture_attention``: ``(logits_BTV, inputs per layer)``."""
    check_windows(model, tokens_BT, lengths_B)
    tokens_BT, lengths_B = _on_model(model, tokens_BT, lengths_B)
    with inference(model), capture_attention(model) as records:
        logits_BTV = model(tokens_BT, lengths_B)
    return logits_BTV, records


# ---- support removal --------------------------------------------------------------------------


def removal_masks_LBT(
    lengths_B: torch.Tensor, T: int, p: float, n_layers: int, seed: int, n_sinks: int = N_SINKS
) -> torch.Tensor:
    """``removed_LBT``: one ``sample_removal_mask_BT`` per layer, in layer order, from a CPU
    generator seeded with ``seed`` (so the masks of a smaller p are subsets of a larger p's)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack(
        [sample_removal_mask_BT(lengths_B, T, p, generator, n_sinks) for _ in range(n_layers)]
    )


def _check_removal(ps: Sequence[float], protocols: Sequence[str]) -> None:
    for p in ps:
        removal_count(0, p)  # the range check, naming p
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or not protocols:
        raise ValueError(f"unknown support-removal protocol(s) {bad}; choose from {PROTOCOLS}")


def _reference_pass(model, tokens_BT, lengths_B) -> list[AttentionInputs]:
    with swapped_attention(model, layer_attention_BHTD) as records:
        model(tokens_BT, lengths_B)
    return records


def _compound_pass(model, tokens_BT, lengths_B, masks_LBT) -> list[torch.Tensor]:
    with swapped_attention(model, lambda x: layer_attention_BHTD(x, masks_LBT[x.layer])) as recs:
        model(tokens_BT, lengths_B)
    return [r.out_BHTD for r in recs]


def layer_perturbations(
    model, tokens_BT, lengths_B, masks_LBT: torch.Tensor, protocol: str, reference=None
) -> list[torch.Tensor]:
    """``delta_B`` per layer for one batch and one set of masks (module doc); ``reference``:
    the records of ``_reference_pass`` when already run. Call under ``inference(model)``."""
    ref = reference if reference is not None else _reference_pass(model, tokens_BT, lengths_B)
    if protocol == "isolated":
        tilde = [layer_attention_BHTD(r, masks_LBT[r.layer]) for r in ref]
    else:
        tilde = _compound_pass(model, tokens_BT, lengths_B, masks_LBT)
    return [
        relative_perturbation_B(r.out_BHTD, t, lengths_B) for r, t in zip(ref, tilde, strict=True)
    ]


def support_removal_by_layer(
    model,
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    ps: Sequence[float] = (0.1, 0.3, 0.5),
    seed: int = 0,
    protocol: str | Sequence[str] = "compound",
    batch_size: int | None = None,
    n_sinks: int = N_SINKS,
) -> pd.DataFrame:
    """Tidy table ``layer, p, perturbation, std, n_sequences, protocol``: the mean over sequences
    of the relative change of each layer's attention output (``protocol``: ``isolated``,
    ``compound`` or a list of both; one reference pass serves all)."""
    protocols = [protocol] if isinstance(protocol, str) else list(protocol)
    _check_removal(ps, protocols)
    check_windows(model, tokens_BT, lengths_B)
    tokens_BT, lengths_B = _on_model(model, tokens_BT, lengths_B)
    n_layers, T = len(model.attention_layers), tokens_BT.shape[1]
    masks = {p: removal_masks_LBT(lengths_B, T, p, n_layers, seed, n_sinks) for p in ps}
    deltas = {name: {(i, p): [] for i in range(n_layers) for p in ps} for name in protocols}
    with inference(model):
        for s in _chunks(tokens_BT.shape[0], batch_size):
            ref = _reference_pass(model, tokens_BT[s], lengths_B[s])
            for name in protocols:
                for p in ps:
                    per_layer = layer_perturbations(
                        model, tokens_BT[s], lengths_B[s], masks[p][:, s], name, ref
                    )
                    for i, delta_B in enumerate(per_layer):
                        deltas[name][(i, p)].append(delta_B.cpu())
    tables = [support_removal_table(d).assign(protocol=name) for name, d in deltas.items()]
    return pd.concat(tables, ignore_index=True)


# ---- row sums and gates -----------------------------------------------------------------------


def row_sum_cv_by_layer(
    model, tokens_BT: torch.Tensor, lengths_B: torch.Tensor, batch_size: int | None = None
) -> pd.DataFrame:
    """Tidy table ``layer, row_sum_cv_norm, row_sum_cv_norm_std, row_sum_cv_raw,
    row_sum_cv_raw_std, n``: the mean (and spread) over (sequence, head) of the CV of the row
    sums across query positions, length-normalised and raw (``probes/rowsum.py``), float64
    weights; ``n`` counts the (sequence, head) pairs."""
    check_windows(model, tokens_BT, lengths_B)
    layers = range(len(model.attention_layers))
    cvs: dict[str, dict[int, list[torch.Tensor]]] = {}
    for s in _chunks(tokens_BT.shape[0], batch_size):
        _, records = captured_attention(model, tokens_BT[s], lengths_B[s])
        for r in records:
            a_BHTT = layer_weights_BHTT(r, torch.float64)
            both = row_sum_cvs_BH(a_BHTT, r.lengths_B, kind=r.kind, causal=r.causal)
            for stat, cv_BH in both.items():
                cvs.setdefault(stat, {i: [] for i in layers})[r.layer].append(cv_BH.cpu())
    return row_sum_cv_table(cvs)


def _check_gated(model) -> None:
    if not model.cfg.gates:
        raise ValueError(
            "the model has no gates (model.gates=False): gate probes need a gated cell"
        )


def _gate_forward(model, tokens_BT, lengths_B) -> list[torch.Tensor]:
    tokens_BT, lengths_B = _on_model(model, tokens_BT, lengths_B)
    with inference(model):
        model(tokens_BT, lengths_B)
    return [g.detach() for g in model.gates]


def gate_binarization_by_layer(
    model, tokens_BT: torch.Tensor, lengths_B: torch.Tensor, batch_size: int | None = None
) -> pd.DataFrame:
    """Tidy table ``layer, gate_mean, frac_below_0.05, frac_above_0.95, binarization, count``
    per gate layer (``probes/gates.py``: strict thresholds, valid positions only)."""
    _check_gated(model)
    check_windows(model, tokens_BT, lengths_B)
    total = None
    for s in _chunks(tokens_BT.shape[0], batch_size):
        gates = _gate_forward(model, tokens_BT[s], lengths_B[s])
        lengths = lengths_B[s].to(gates[0].device)
        if gates[0].dim() == 3:  # per head: each (token, head) is one gate
            H = gates[0].shape[1]
            gates, lengths = [g.flatten(0, 1) for g in gates], lengths.repeat_interleave(H)
        sums = gate_sums(gates, lengths)
        total = sums if total is None else total + sums
    return gate_stats_table(total).rename(columns=GATE_COLUMNS)


def token_gates(
    model,
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    pieces_fn: PiecesFn,
    batch_size: int | None = None,
) -> tuple[list[str], np.ndarray]:
    """``(pieces_N, gates_LN)`` over the valid positions (row by row), heads averaged; positions
    whose piece is None (end-of-text) are left out."""
    _check_gated(model)
    check_windows(model, tokens_BT, lengths_B)
    pieces, columns = [], []
    for s in _chunks(tokens_BT.shape[0], batch_size):
        gates = _gate_forward(model, tokens_BT[s], lengths_B[s])
        g_LBT = torch.stack([g.mean(dim=1) if g.dim() == 3 else g for g in gates]).cpu()
        for b, n in enumerate(lengths_B[s].tolist()):
            ids = tokens_BT[s][b, :n].tolist()
            got = list(pieces_fn(ids))
            if len(got) != n:
                raise ValueError(f"pieces_fn returned {len(got)} pieces for {n} token ids")
            keep = [t for t, piece in enumerate(got) if piece is not None]
            pieces += [got[t] for t in keep]
            columns.append(g_LBT[:, b, keep].double().numpy())
    return pieces, np.concatenate(columns, axis=1)


def gates_by_token_category(
    model, tokens_BT, lengths_B, pieces_fn: PiecesFn, batch_size: int | None = None
) -> pd.DataFrame:
    """``category, count, mean_gate`` (``probes/token_categories.py``): the paper's Table 4 for
    one model; each position's gate is first averaged over the gate layers."""
    return gate_by_category(*token_gates(model, tokens_BT, lengths_B, pieces_fn, batch_size))


def extreme_gate_tokens(
    model,
    tokens_BT,
    lengths_B,
    pieces_fn: PiecesFn,
    k: int = 10,
    min_count: int = 1,
    batch_size: int | None = None,
) -> pd.DataFrame:
    """The ``k`` lowest- and highest-gate token types: ``end, rank, piece, category, count,
    mean_gate`` (``token_categories.extreme_tokens``)."""
    pieces, gates_LN = token_gates(model, tokens_BT, lengths_B, pieces_fn, batch_size)
    return extreme_tokens(pieces, gates_LN, k=k, min_count=min_count)


# ---- the study's tables over several models ---------------------------------------------------
#
# One ``cell`` column in every table (the key of ``models``); every model reads the same windows
# (same ids: one vocabulary for all cells). Means over layers give the paper's summary numbers.


def model_kind(model) -> str:
    """``softmax`` or ``sigmoid``: the kind of the model's attention backends (one for all)."""
    kinds = {attention_kind(a.backend_name) for a in model.attention_layers}
    if len(kinds) != 1:
        raise ValueError(f"the model mixes attention kinds {sorted(kinds)}")
    return kinds.pop()


def _check_models(models: Mapping[str, torch.nn.Module], tokens_BT, lengths_B) -> None:
    if not models:
        raise ValueError("the probe tables need at least one model")
    for cell, model in models.items():
        try:
            check_windows(model, tokens_BT, lengths_B)
            model_kind(model)
        except ValueError as e:
            raise ValueError(f"cell {cell!r}: {e}") from None


def _with_cell(frame: pd.DataFrame, cell: str, **columns) -> pd.DataFrame:
    out = frame.copy()
    for i, (name, value) in enumerate({"cell": cell, **columns}.items()):
        out.insert(i, name, value)
    return out


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """Rows of every model, or an empty table with the columns when none has any."""
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def support_removal_tables(
    models: Mapping[str, torch.nn.Module],
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    ps: Sequence[float] = (0.1, 0.3, 0.5),
    seed: int = 0,
    protocols: Sequence[str] = PROTOCOLS,
    batch_size: int | None = None,
) -> dict[str, pd.DataFrame]:
    """``support_removal`` (``cell, kind, layer, p, perturbation, std, n_sequences, protocol``)
    and ``support_removal_summary`` (per cell, protocol and p, the mean over layers: the
    paper's 0.574 / 0.579 at p = 0.1)."""
    _check_removal(ps, protocols)
    _check_models(models, tokens_BT, lengths_B)
    frames = [
        _with_cell(
            support_removal_by_layer(model, tokens_BT, lengths_B, ps, seed, protocols, batch_size),
            cell,
            kind=model_kind(model),
        )
        for cell, model in models.items()
    ]
    table = pd.concat(frames, ignore_index=True)
    summary = table.groupby(["cell", "kind", "protocol", "p"], as_index=False, sort=False).agg(
        perturbation=("perturbation", "mean"), n_layers=("layer", "nunique")
    )
    return {"support_removal": table, "support_removal_summary": summary}


def _rowsum_binarization(model, tokens_BT, lengths_B, batch_size) -> pd.DataFrame:
    """One row per layer: row-sum CVs and, for a gated model, its gate layer's binarization."""
    rows = row_sum_cv_by_layer(model, tokens_BT, lengths_B, batch_size)
    rows = rows.rename(columns={"n": "n_sequence_heads"})
    gate_cols = list(GATE_COLUMNS.values())
    if not model.cfg.gates:
        return rows.assign(**{c: np.nan for c in gate_cols})
    gates = gate_binarization_by_layer(model, tokens_BT, lengths_B, batch_size)
    return rows.merge(gates[["layer", *gate_cols]], on="layer", how="left")


def _mean_keeping_nan(values: pd.Series) -> float:
    return values.mean(skipna=False)


def rowsum_binarization_tables(
    models: Mapping[str, torch.nn.Module],
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    batch_size: int | None = None,
) -> dict[str, pd.DataFrame]:
    """``rowsum_binarization`` (``cell, kind, gated, layer, row_sum_cv_norm,
    row_sum_cv_norm_std, row_sum_cv_raw, row_sum_cv_raw_std, n_sequence_heads, gate_mean,
    frac_below_0.05, frac_above_0.95, binarization``; the gate columns are NaN for a dense cell
    and for the last layer, which emits no gate) and ``rowsum_binarization_summary`` (per cell,
    means over layers: the paper's row-sum CV 0.484 and aggregate binarization 24.4%, every gate
    layer counting the same positions). The paper's CV is ``row_sum_cv_raw`` as written; set
    beside it ``row_sum_cv_norm``, which row length does not inflate (``probes/rowsum.py``).
    The row-sum means keep NaN (a layer with a 0/0 CV); the gate means skip the NaN of the
    layer that emits no gate."""
    _check_models(models, tokens_BT, lengths_B)
    frames = [
        _with_cell(
            _rowsum_binarization(model, tokens_BT, lengths_B, batch_size),
            cell,
            kind=model_kind(model),
            gated=bool(model.cfg.gates),
        )
        for cell, model in models.items()
    ]
    table = pd.concat(frames, ignore_index=True)
    summary = table.groupby(["cell", "kind", "gated"], as_index=False, sort=False).agg(
        row_sum_cv_norm=("row_sum_cv_norm", _mean_keeping_nan),
        row_sum_cv_raw=("row_sum_cv_raw", _mean_keeping_nan),
        gate_mean=("gate_mean", "mean"),
        binarization=("binarization", "mean"),
    )
    return {"rowsum_binarization": table, "rowsum_binarization_summary": summary}


def gate_category_tables(
    models: Mapping[str, torch.nn.Module],
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    pieces_fn: PiecesFn,
    k: int = 10,
    min_count: int = 5,
    batch_size: int | None = None,
) -> dict[str, pd.DataFrame]:
    """Gated cells only (dense ones are skipped): ``table4_categories`` (``cell, category,
    count, mean_gate``) and ``extreme_tokens`` (``cell, end, rank, piece, category, count,
    mean_gate``: the ``k`` lowest / highest types seen at least ``min_count`` times)."""
    _check_models(models, tokens_BT, lengths_B)
    categories, extremes = [], []
    for cell, model in models.items():
        if not model.cfg.gates:
            continue
        pieces, gates_LN = token_gates(model, tokens_BT, lengths_B, pieces_fn, batch_size)
        categories.append(_with_cell(gate_by_category(pieces, gates_LN), cell))
        table = extreme_tokens(pieces, gates_LN, k=k, min_count=min_count)
        extremes.append(_with_cell(table, cell))
    return {
        "table4_categories": _concat(categories, ["cell", "category", "count", "mean_gate"]),
        "extreme_tokens": _concat(
            extremes, ["cell", "end", "rank", "piece", "category", "count", "mean_gate"]
        ),
    }


def probe_tables(
    models: Mapping[str, torch.nn.Module],
    tokens_BT: torch.Tensor,
    lengths_B: torch.Tensor,
    pieces_fn: PiecesFn,
    ps: Sequence[float] = (0.1, 0.3, 0.5),
    seed: int = 0,
    protocols: Sequence[str] = PROTOCOLS,
    batch_size: int | None = None,
    extreme_k: int = 10,
    extreme_min_count: int = 5,
) -> dict[str, pd.DataFrame]:
    """Every probe table of the study: ``support_removal``, ``support_removal_summary``,
    ``rowsum_binarization``, ``rowsum_binarization_summary``, ``table4_categories``,
    ``extreme_tokens`` (the three functions above; the columns are theirs)."""
    _check_removal(ps, protocols)
    _check_models(models, tokens_BT, lengths_B)
    return {
        **support_removal_tables(models, tokens_BT, lengths_B, ps, seed, protocols, batch_size),
        **rowsum_binarization_tables(models, tokens_BT, lengths_B, batch_size),
        **gate_category_tables(
            models, tokens_BT, lengths_B, pieces_fn, extreme_k, extreme_min_count, batch_size
        ),
    }
