"""Triton kernels for stabilitylab: sigmoid attention and its softmax twin (fwd + bwd, fused
max|logit|), a stats-only max|logit| reduction, and the chunked loss's per-row cross-entropy and
logit gradient. Importing never touches CUDA; CPU runs need TRITON_INTERPRET=1."""

import importlib

from stabilitylab.kernels.logit_max import max_abs_logit
from stabilitylab.kernels.sigmoid_attention import sigmoid_attention
from stabilitylab.kernels.softmax_attention import softmax_attention
from stabilitylab.kernels.triton_support import autotune_choices as _choices_of


def autotune_choices() -> dict[str, str]:
    """The configs the production kernels' autotuners picked in this process so far; the softmax
    kernels launch through the sigmoid module's launcher and are listed with its. (The modules by
    import path: this package re-exports functions under the modules' names.)"""
    out = {}
    for name in ("sigmoid_attention", "logit_max"):
        out.update(_choices_of(importlib.import_module(f"stabilitylab.kernels.{name}")._TUNED))
    return out


__all__ = ["autotune_choices", "max_abs_logit", "sigmoid_attention", "softmax_attention"]
