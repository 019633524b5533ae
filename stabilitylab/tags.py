"""TensorBoard tag names: the one place they are spelled. The README documents them.

Per-layer tags end in ``layer_{i}`` (0 = the layer nearest the embeddings); per-head tags add
``/head_{h}``. Analysis code parses tags with these helpers, never with ad-hoc strings.
"""

LOSS = "train/loss"  # the step's loss: mean masked- or next-token CE (+ BUDGET_LOSS if gated)
LR = "train/lr"
GRAD_NORM = "train/grad_norm"  # global L2 norm of all gradients, before any clipping
TOKENS_PER_S = "perf/tokens_per_s"  # valid tokens per second, all processes
STEP_TIME = "perf/step_time_s"
MFU = "perf/mfu"  # model FLOPs utilisation, valid tokens only (CUDA only)
PEAK_MEM = "perf/peak_mem_gib"  # peak allocated GPU memory of this arm so far (CUDA only)
NONFINITE = "event/nonfinite"  # 1.0 at a step whose loss or gradient was not finite
MAX_LOGIT = "attn/max_logit"  # max over layers and heads of max |q.k|/sqrt(d)

GRAD_NORM_LAYER = "grad_norm/layer_{i}"
PARAM_NORM_LAYER = "param_norm/layer_{i}"
UPDATE_RATIO_LAYER = "update_ratio/layer_{i}"  # ||W_after - W_before|| / ||W_before||
MAX_LOGIT_LAYER = "attn/max_logit/layer_{i}"  # max over heads
MAX_LOGIT_HEAD = "attn/max_logit/layer_{i}/head_{h}"
JACOBIAN_LAYER = "probe/jacobian/layer_{i}"  # power-iteration spectral norm of attention layer


def layer(tag: str, i: int) -> str:
    return tag.format(i=i)


def head(i: int, h: int) -> str:
    return MAX_LOGIT_HEAD.format(i=i, h=h)


# ---- the KV-eviction study (causal decoder with gates); model docstring for the gates --------
CE_LOSS = "train/ce_loss"  # mean next-token (or masked-token) cross-entropy of the step (nats)
BUDGET_LOSS = "train/budget_loss"  # the budget term at the step's lambda (model.budget_loss)
GATE_MEAN = "gate/mean"  # mean gate over gated layers, heads and valid positions
GATE_MEAN_LAYER = "gate/mean/layer_{i}"  # layer i's gate, read by layer i + 1
GATE_LOW_LAYER = "gate/frac_below_0.05/layer_{i}"  # fraction of valid positions with g < 0.05
GATE_HIGH_LAYER = "gate/frac_above_0.95/layer_{i}"  # ... with g > 0.95 (with LOW: binarization)
VAL_LOSS = "val/loss"  # mean cross-entropy on the fixed validation split (nats per token)
VAL_PPL = "val/ppl"  # exp(val/loss)
