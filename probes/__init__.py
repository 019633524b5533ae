"""Probes of attention (library; the scripts are in experiments/probes/).

- ``jacobian``: pure maths: score maps, toy attention layer, exact Jacobians, power iteration.
- ``sweeps``: the tables behind ``experiments/probes/score_map.py``, ``attention_layer.py`` and
  ``estimator_check.py``.
- ``live``: ``JacobianProbe``, the in-training probe; ``experiments/probes/live_cost.py``
  measures its overhead.
- ``masked_attention``: a tiny n x n softmax/sigmoid attention with explicit weights, padding,
  causal mask, per-key bias and removed keys; the eviction probes compute on it.
- ``support_removal``: random K/V removal (first four positions kept) and the relative change
  of a layer's attention output; ``rowsum``: the row-sum coefficient of variation, raw and
  length-normalised.
- ``gates``: per-layer gate mean and binarization, for the trainer's log and the study;
  ``token_categories``: GPT-2 pieces in six categories, mean gate per category, extreme tokens.
- ``model_capture``: what each attention layer of a ``Transformer`` sees (its backend swapped
  inside a ``with`` block, always restored); ``model_probes``: the maths above on a trained
  decoder, per layer and as the study's tables (``probe_tables``); ``probe_text``: evaluation
  windows in a run's ids and their GPT-2 pieces. Scripts: ``experiments/probes/kv_*.py``.
"""

from stabilitylab.probes.gates import (
    GateSums,
    gate_stats,
    gate_stats_LBT,
    gate_stats_table,
    gate_sums,
    pooled_gate_stats,
)
from stabilitylab.probes.masked_attention import attention_weights_BHTT, masked_attention_BHTD
from stabilitylab.probes.model_capture import (
    AttentionInputs,
    capture_attention,
    layer_attention_BHTD,
    swapped_attention,
)
from stabilitylab.probes.model_probes import (
    extreme_gate_tokens,
    gate_binarization_by_layer,
    gate_category_tables,
    gates_by_token_category,
    probe_tables,
    removal_masks_LBT,
    row_sum_cv_by_layer,
    rowsum_binarization_tables,
    support_removal_by_layer,
    support_removal_tables,
)
from stabilitylab.probes.rowsum import (
    row_mass_BT,
    row_sum_cv_BH,
    row_sum_cv_table,
    row_sum_cvs_BH,
    row_sum_cvs_from_qk_BH,
)
from stabilitylab.probes.support_removal import (
    layer_average_by_p,
    mean_over_sequences,
    relative_perturbation_B,
    removal_count,
    sample_removal_mask_BT,
    support_removal_perturbation_B,
    support_removal_table,
)
from stabilitylab.probes.token_categories import (
    CATEGORIES,
    STOPWORDS,
    extreme_tokens,
    gate_by_category,
    token_category,
)

__all__ = [
    "AttentionInputs",
    "capture_attention",
    "layer_attention_BHTD",
    "swapped_attention",
    "extreme_gate_tokens",
    "gate_binarization_by_layer",
    "gate_category_tables",
    "gates_by_token_category",
    "probe_tables",
    "removal_masks_LBT",
    "row_sum_cv_by_layer",
    "rowsum_binarization_tables",
    "support_removal_by_layer",
    "support_removal_tables",
    "CATEGORIES",
    "STOPWORDS",
    "GateSums",
    "attention_weights_BHTT",
    "extreme_tokens",
    "gate_by_category",
    "gate_stats",
    "gate_stats_LBT",
    "gate_stats_table",
    "gate_sums",
    "layer_average_by_p",
    "masked_attention_BHTD",
    "mean_over_sequences",
    "pooled_gate_stats",
    "relative_perturbation_B",
    "removal_count",
    "row_mass_BT",
    "row_sum_cv_BH",
    "row_sum_cv_table",
    "row_sum_cvs_BH",
    "row_sum_cvs_from_qk_BH",
    "sample_removal_mask_BT",
    "support_removal_perturbation_B",
    "support_removal_table",
    "token_category",
]
