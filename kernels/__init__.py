"""Triton kernels for stabilitylab: sigmoid attention (fwd + bwd, fused max|logit|) and a
stats-only max|logit| reduction. Importing never touches CUDA; CPU runs need TRITON_INTERPRET=1."""

from stabilitylab.kernels.logit_max import max_abs_logit
from stabilitylab.kernels.sigmoid_attention import sigmoid_attention

__all__ = ["max_abs_logit", "sigmoid_attention"]
