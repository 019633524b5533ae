"""Analysis of run directories: event files -> tidy scalars, divergence detectors, early
warning, the per-run report and the LR sweep.

    python analysis/report.py runs/smoke      # -> runs/smoke/report/
    python analysis/sweep.py runs/            # -> runs/sweep/

Modules: ``events`` (reading), ``detectors`` (pure numpy rules, also used online by the
trainer), ``early_warning``, ``stats``, ``plots``, ``markdown``, ``report``, ``sweep``.
Importing this package loads nothing heavy; ``plots`` / ``report`` / ``sweep`` pull in matplotlib.
"""
