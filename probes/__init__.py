"""Jacobian and Lipschitz probes of attention.

- ``jacobian``: pure maths: score maps, toy attention layer, exact Jacobians, power iteration.
- ``sweeps``: the tables behind the scripts (``score_map.py``, ``attention_layer.py``,
  ``estimator_check.py``; run them as ``python probes/<name>.py``).
- ``live``: ``JacobianProbe``, the in-training probe; ``live_cost.py`` measures its overhead.
"""
