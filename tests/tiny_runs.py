"""A tiny smoke-preset sigmoid arm that trains in about a second a step on a CPU, shared by the
checkpoint and resume tests: two micro-batches per step, every step logged. Those modules run
on one thread (the ``one_thread`` fixture of conftest.py)."""

from pathlib import Path

from stabilitylab import config as C

TINY = [
    "--model.d_model=32",
    "--model.n_heads=2",
    "--model.d_ff=64",
    "--data.context_len=32",
    "--data.min_genes=8",
    "--data.n_genes=64",
    "--data.genes_per_program=16",
    "--train.global_batch=4",
    "--train.micro_batch=2",
    "--telemetry.probe_every=0",
    "--telemetry.log_every=1",
    "--report=False",
]


def tiny(out_dir, *overrides) -> C.Config:
    return C.parse(
        ["--preset", "smoke", "--arm=sigmoid", f"--out_dir={out_dir}", *TINY, *overrides]
    )


def arm_dir(out_dir) -> Path:
    return Path(out_dir) / "smoke" / "sigmoid"
