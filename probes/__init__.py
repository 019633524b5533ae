"""Jacobian and Lipschitz probes of attention (library; the scripts are in experiments/probes/).

- ``jacobian``: pure maths: score maps, toy attention layer, exact Jacobians, power iteration.
- ``sweeps``: the tables behind ``experiments/probes/score_map.py``, ``attention_layer.py`` and
  ``estimator_check.py``.
- ``live``: ``JacobianProbe``, the in-training probe; ``experiments/probes/live_cost.py``
  measures its overhead.
"""
