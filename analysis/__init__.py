"""Analysis of run directories: event files -> tidy scalars, divergence detectors, early
warning, the per-run report and the LR sweep.

    python analysis/report.py runs/smoke      # -> runs/smoke/report/
    python analysis/sweep.py runs/            # -> runs/sweep/

Modules: ``events`` (reading), ``detectors`` (pure numpy rules, also used online by the
trainer), ``early_warning``, ``stats``, ``settings`` (the config keys runs differ in), ``rates``
(outcome rates and false alarms over repeated runs), ``identity`` (are two runs bit-identical),
``mechanism`` (logit growth or an early transient: what a failure followed), ``plots``,
``markdown``, ``report``, ``sweep``, ``map``.
Importing this package loads nothing heavy; ``plots`` / ``report`` / ``sweep`` pull in matplotlib.
"""
