"""Typed configuration: a dataclass tree, the arms of both studies, command-line overrides.

    python experiments/stress_8k.py --preset smoke --train.lr=3e-3 --arm softmax
    python experiments/stress_8k.py --preset smoke --help     # every key, with smoke's defaults
    python experiments/kv_eviction.py --preset tiny --cells sm-rope sig-g-rope

A preset (``stabilitylab.presets``) sets every default; ``--section.key=value`` overrides one key.
Every field is checked in ``__post_init__`` (numbers must be finite); an unknown key or a bad value
stops the program before any work, naming the key. Stress knobs (learning-rate scale, warmup,
context, depth/width, init scale, QK-LayerNorm, sigmoid bias, clipping) are plain fields with the
paper's values as defaults.

The task follows the data: cells (``data.source`` synthetic | h5ad) train a bidirectional encoder
on masked tokens and pair the arms ``softmax`` / ``sigmoid`` (``--arm``); text (``data.source=text``)
trains a causal decoder on next tokens in the KV-eviction study's cells (``--cells``). An arm or a
cell is a name; :meth:`Config.arm_config` gives the config it trains with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

PRESET_NAMES = (
    "stress_8k", "smoke", "proxy", "proxy_hot", "diverge_fast", "stress_8k_hot",  # stress study
    "tiny", "reduced", "paper",  # the KV-eviction study
)  # fmt: skip
"""The keys of ``stabilitylab.presets.PRESETS``, in order (that module checks they agree)."""
PresetName = Literal[PRESET_NAMES]  # the type of Config.preset: tyro lists the names in --help

N_SPECIAL_TOKENS = 3  # PAD=0, MASK=1, CLS=2; gene g has token id g + 3

NOT_DETERMINISTIC = {
    "softmax": "SDPA's backward differs run to run; cuDNN refuses deterministic mode",
    "softmax-flex": "FlexAttention scatters the key bias's gradient with atomic adds",
}
"""The registered attention backends (stabilitylab.attention) that may differ run to run on a GPU,
and why; train.deterministic refuses them. Here, not in the registry: this module imports no
torch."""


TRITON_HEAD_DIMS = (64, 128)
"""The head dims the lab's Triton kernels take (``kernels/triton_support.SUPPORTED_HEAD_DIMS``; a
test keeps the two equal). Here too because this module imports neither torch nor triton."""
TRITON_BACKENDS = ("sigmoid-triton", "sigmoid-triton-exact", "softmax-triton")
"""The backends that run those kernels: another head dim is refused when one is named, and
``auto`` then picks the eager reference (``Config.backend_for``)."""


def deterministic_softmax(cuda: bool) -> str:
    """The softmax backend train.deterministic runs: the Triton kernel on a GPU, the eager n x n
    reference on a CPU."""
    return "softmax-triton" if cuda else "softmax-reference"


class ConfigError(Exception):
    """A configuration value is invalid; the message names the key.

    Not a ValueError on purpose: tyro draws its own multi-line box for a ValueError raised while
    it builds the config; this one reaches the entry point, which prints it on one line
    (``stabilitylab.cli.cli_errors``).
    """


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config {key}: {msg}")


def _check_literals(obj: object, prefix: str, keys: tuple[str, ...]) -> None:
    """Literal fields hold one of their kinds, also when built from a dict (a saved config)."""
    from typing import get_args, get_type_hints

    hints = get_type_hints(type(obj))
    for key in keys:
        kinds, value = get_args(hints[key]), getattr(obj, key)
        _check(value in kinds, f"{prefix}{key}", f"unknown kind {value!r}; choose one of {kinds}")


def check_finite(obj: object, prefix: str) -> None:
    """Refuse NaN and infinity in every float field of the dataclass ``obj`` (None passes).

    Generic so that a field added later is covered without a line of its own: an infinite lr
    or a NaN bias would otherwise pass the range checks (``inf > 0``) or have none, and show up
    as a "divergence" at step 1.
    """
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"config {prefix}{f.name}: must be a finite number, got {v}")


@dataclass
class ModelConfig:
    n_layers: int = 12
    """Transformer blocks."""
    d_model: int = 768
    """Width of the residual stream."""
    n_heads: int = 12
    """Attention heads per block; head_dim = d_model / n_heads."""
    d_ff: int = 3072
    """Hidden width of each block's feed-forward layer."""
    dropout: float = 0.02
    """Dropout on the embeddings and on each block's attention and feed-forward outputs."""
    ln_eps: float = 1e-5
    """LayerNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix and embedding."""
    init_scale: float = 1.0
    """Stress knob: multiplies init_std for every weight."""
    qk_layernorm: bool = False
    """Stress knob: LayerNorm on queries and keys per head (Wortsman et al. 2023)."""
    sigmoid_bias: float | None = None
    """Stress knob: sigmoid bias b; None means b = -log(n_valid) per sequence."""
    causal: bool = False
    """A causal decoder (next-token LM; tied input/output embeddings as in GPT-2). False: the
    bidirectional encoder with its masked-token head."""
    position: Literal["learned", "rope", "none"] = "learned"
    """Positions: learned absolute vectors, rope (rotary on q and k after qk_norm; needs an even
    head dim), none (NoPE: no rotation and no position vector)."""
    rope_base: float = 10_000.0
    """RoPE's base: pair p of a head rotates by position * rope_base^(-2p / head_dim)."""
    qk_norm: Literal["none", "layernorm", "rmsnorm"] = "none"
    """Norm on queries and keys per head, before RoPE: layernorm (what qk_layernorm=True means)
    or rmsnorm (QK-RMSNorm with a learnable gain, the KV-eviction paper's)."""
    gates: bool = False
    """KV-eviction gates: layer l < n_layers-1 emits g_j = sigmoid(w.h_j + b) per token (w=0 and
    b=gate_bias_init at init, h = layer l's output); layer l+1 adds log(g_j + 1e-8) to its logits
    for key j and scales v_j by g_j. Needs n_layers >= 2."""
    gate_injection: Literal["both", "logits", "values"] = "both"
    """Where the gate enters the next layer: both (the paper), logits only, values only."""
    gate_per_head: bool = False
    """One gate per (token, head) instead of one per token shared by the heads."""
    gate_in_kernel: bool = False
    """With gate_injection=both and a Triton sigmoid backend: the gate goes into the attention
    kernel itself (log(g + 1e-8) on the logits, g on the values, its gradient from the dK/dV
    kernel) instead of a key bias and g * v around it: the same maths in one op. Other backends
    ignore it."""
    gate_bias_init: float = 5.0
    """The gates' initial bias b (the paper: 5, so g = sigmoid(5) = 0.9933 at step 0)."""

    def _check_kinds(self) -> None:
        """Literal fields hold one of their kinds, also when built from a dict (a saved config)."""
        _check_literals(self, "model.", ("position", "qk_norm", "gate_injection"))
        for key in ("causal", "gates", "gate_per_head", "gate_in_kernel", "qk_layernorm"):
            value = getattr(self, key)
            _check(isinstance(value, bool), f"model.{key}", f"must be True or False, got {value!r}")

    def _check_new_knobs(self) -> None:
        self._check_kinds()
        _check(
            not (self.qk_layernorm and self.qk_norm == "rmsnorm"),
            "model.qk_layernorm",
            "qk_layernorm=True means qk_norm='layernorm', which contradicts qk_norm='rmsnorm'",
        )
        _check(
            self.position != "rope" or self.head_dim % 2 == 0,
            "model.position",
            f"rope needs an even head dim, got d_model/n_heads = {self.head_dim}",
        )
        _check(self.rope_base > 1.0, "model.rope_base", f"must be > 1, got {self.rope_base}")
        _check(
            not self.gates or self.n_layers >= 2,
            "model.gates",
            f"need n_layers >= 2 (the last layer has no gate), got n_layers={self.n_layers}",
        )
        _check(
            abs(self.gate_bias_init) < float("inf"),
            "model.gate_bias_init",
            f"must be finite, got {self.gate_bias_init}",
        )

    @property
    def qk_norm_kind(self) -> str:
        """The norm the model applies: qk_layernorm=True is the older spelling of 'layernorm'."""
        return "layernorm" if self.qk_layernorm else self.qk_norm

    def __post_init__(self) -> None:
        check_finite(self, "model.")
        for k in ("n_layers", "d_model", "n_heads", "d_ff"):
            _check(getattr(self, k) > 0, f"model.{k}", f"must be positive, got {getattr(self, k)}")
        _check(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}",
        )
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(self.ln_eps > 0, "model.ln_eps", f"must be positive, got {self.ln_eps}")
        _check(self.init_std > 0, "model.init_std", f"must be positive, got {self.init_std}")
        _check(self.init_scale > 0, "model.init_scale", f"must be positive, got {self.init_scale}")
        self._check_new_knobs()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class DataConfig:
    source: Literal["synthetic", "h5ad", "text"] = "synthetic"
    """Cells from the synthetic generator or an AnnData .h5ad file (h5ad_path): masked-token
    training of an encoder. text: next-token training of a causal decoder on token shards
    (data.text says which)."""
    text: Literal["corpus", "sample", "files", "hf"] = "corpus"
    """Token shards of data.source=text: corpus (the offline English corpus `make data` builds
    under data/text/), sample (the tiny pre-tokenised sample shipped in the package), files
    (data.text_files, tokenised once and cached), hf (the Hugging Face dataset data.hf_dataset)."""
    text_files: list[str] = field(default_factory=list)
    """Local text files, one document each (data.text=files)."""
    hf_dataset: str | None = None
    """Hugging Face dataset name or a folder saved with save_to_disk (data.text=hf)."""
    hf_split: str = "train"
    """Split of data.hf_dataset to read (it is then cut into train / val / test shards)."""
    hf_text_column: str = "text"
    """Column of data.hf_dataset that holds the text."""
    vocab: Literal["gpt2", "compact"] = "gpt2"
    """Token ids of data.source=text. gpt2: GPT-2's BPE ids (50,257 rows of embedding and head).
    compact: only the ids that occur in the shards' three splits (and end-of-text), renumbered in
    id order; the CPU preset's shortcut (the shipped sample has 595, so the head is 84x narrower);
    perplexity is then over that vocabulary. vocab.json of each run maps the ids back."""
    h5ad_path: str | None = None
    """Path to an AnnData .h5ad file (source=h5ad); genes come from var_names."""
    h5ad_layer: str = "X"
    """Matrix of the .h5ad file that holds the counts: X, raw (.raw.X), or a name in .layers."""
    context_len: int = 8192
    """Stress knob: maximum tokens per cell (the top-expressed genes, in rank order)."""
    pad_to_multiple: int = 1
    """Cell batches: round each micro-batch's length up to a multiple of this (it must divide
    context_len). A jagged run then meets at most context_len / pad_to_multiple sequence lengths
    instead of one per cell length, so a backend that prepares itself per new length (cuDNN's
    SDPA builds an execution plan, ~85 ms on the H200) pays that a bounded number of times. The
    padding is masked: each cell's tokens, labels, loss and sigmoid bias (-log of its own length)
    stay the same. 1: each batch as long as its longest cell."""
    n_genes: int = 44_000
    """Gene vocabulary of the synthetic generator (h5ad: taken from the file)."""
    n_cell_types: int = 64
    """Synthetic cell types; each activates its own mix of programs."""
    n_programs: int = 256
    """Synthetic co-regulated gene programs."""
    genes_per_program: int = 400
    """Genes drawn into each synthetic program (programs overlap)."""
    min_genes: int = 256
    """Fewest expressed genes a synthetic cell keeps (lengths are jagged up to context_len)."""
    mask_prob: float = 0.15
    """Chance that a token is picked for prediction (BERT: 80% MASK, 10% random, 10% kept)."""
    dispersion: float = 2.0
    """Negative-binomial shape r (smaller = more over-dispersed)."""
    dropout_rate: float = 0.3
    """Extra zero-inflation: chance an expressed gene is not captured."""

    def __post_init__(self) -> None:
        check_finite(self, "data.")
        _check(self.context_len >= 2, "data.context_len", f"must be >= 2, got {self.context_len}")
        _check(
            isinstance(self.pad_to_multiple, int)
            and self.pad_to_multiple >= 1
            and self.context_len % self.pad_to_multiple == 0,
            "data.pad_to_multiple",
            f"must be a positive divisor of data.context_len={self.context_len}, "
            f"got {self.pad_to_multiple!r}",
        )
        _check_literals(self, "data.", ("source", "text", "vocab"))
        if self.source == "text":
            self._check_text()
        else:
            self._check_cells()

    def _check_text(self) -> None:
        """The token shards' keys (data.source=text)."""
        _check(
            self.pad_to_multiple == 1,
            "data.pad_to_multiple",
            "applies to cell batches only (text windows are all data.context_len long); leave it 1",
        )
        if self.text == "files":
            _check(bool(self.text_files), "data.text_files", "is required when data.text=files")
        if self.text == "hf":
            _check(bool(self.hf_dataset), "data.hf_dataset", "is required when data.text=hf")

    def _check_cells(self) -> None:
        """The cell generator's and masking's keys (data.source synthetic or h5ad)."""
        _check(self.n_genes >= 8, "data.n_genes", f"must be >= 8, got {self.n_genes}")
        _check(
            0.0 < self.mask_prob < 1.0, "data.mask_prob", f"must be in (0, 1), got {self.mask_prob}"
        )
        _check(
            0 < self.min_genes <= self.context_len,
            "data.min_genes",
            f"must be in [1, context_len={self.context_len}], got {self.min_genes}",
        )
        _check(self.n_cell_types > 0, "data.n_cell_types", "must be positive")
        _check(self.n_programs > 0, "data.n_programs", "must be positive")
        _check(
            0 < self.genes_per_program <= self.n_genes,
            "data.genes_per_program",
            f"must be in [1, n_genes={self.n_genes}], got {self.genes_per_program}",
        )
        _check(self.dispersion > 0, "data.dispersion", "must be positive")
        _check(0.0 <= self.dropout_rate < 1.0, "data.dropout_rate", "must be in [0, 1)")
        _check(
            bool(self.h5ad_layer) and self.h5ad_layer.strip() == self.h5ad_layer,
            "data.h5ad_layer",
            f"must be X, raw or the name of a layer, got {self.h5ad_layer!r}",
        )
        if self.source == "h5ad":
            _check(bool(self.h5ad_path), "data.h5ad_path", "is required when data.source=h5ad")


@dataclass
class TrainConfig:
    steps: int = 80_000
    """Optimizer steps."""
    global_batch: int = 256
    """Sequences per optimizer step, over all processes."""
    micro_batch: int = 1
    """Sequences per process per forward; accumulation = global_batch / (micro_batch * processes)."""
    group_by_length: bool = False
    """Cut each step into micro-batches of like length: the process's sequences of the step are
    ordered longest first before they are grouped micro_batch at a time, so jagged cells carry
    little padding. The step's sequences, its summed loss and its gradient are the same; only
    their rounding and the dropout draws change. No effect at micro_batch 1 or on text windows
    (all of one length)."""
    lr: float = 1e-4
    """Peak learning rate of AdamW (before lr_scale)."""
    lr_scale: float = 1.0
    """Stress knob: multiplies lr."""
    warmup_steps: int = 10_000
    """Stress knob: linear warmup length, then constant."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices and embeddings (biases and LayerNorm gains: none)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.999
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_grad: float | None = None
    """Stress knob: max global grad norm; None (stress presets) = no clipping."""
    seed: int = 42
    """Seed of the weights, the data order and the masks (both arms share it)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """The default only: a mixed precision from `accelerate launch` (its --mixed_precision,
    --config_file, or the `accelerate config` file) or ACCELERATE_MIXED_PRECISION wins.
    auto: bf16 autocast on CUDA, fp32 on CPU."""
    on_divergence: Literal["stop", "continue"] = "stop"
    """Policy once the run is diverged (non-finite, or loss+grad-norm detectors fire)."""
    checkpoint_every: int = 1000
    """Steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT)."""
    compile: bool = False
    """torch.compile the model (Module.compile); the kernels are opaque custom ops in the graph.
    train.fast does this and more; the two are not combined."""
    fast: bool = False
    """The fast step (stabilitylab.train.fast): the model compiled with fullgraph=True (a graph
    break falls back, its reason printed), the loss through the chunked cross-entropy (no full
    logits), the head's rows padded to a multiple of 64, the one-pass q/k/v gradient. The same
    function as the eager step, rounded differently (and dropout drawn by inductor's RNG): over
    200 steps on the GPU its curves moved by as much as the eager step's own rounding yardstick
    (experiments/bench/fast_vs_eager.py, docs/BENCHMARKS.md). On where it pays: ``stress_8k``
    (1.46x the trainer's step at 8K) and ``paper`` (the KV study at full scale: the gated
    decoder's step 1.5-1.7x faster at the reduced shape, for a 50-60 s compile per cell). Off
    where it does not, or cannot: the proxy presets (on the H200 their compiled step was 7-8%
    slower and a 300-step run took 3-4x the wall time), ``reduced`` (800 steps a cell: the compile
    costs more than the faster step saves), the CPU presets, and ``stress_8k_hot``, which runs
    deterministic. The recorded results of the proxy and divergence presets ran the eager step.
    --train.fast=True / False switches it; a resumed run may switch it."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOPS for MFU; None = from the GPU name (H100/H200: 989)."""
    budget_lambda: float = 0.03
    """Gated models only: the loss is CE + lambda * (mean gate, normalised by budget_norm), lambda
    = budget_lambda (the KV-eviction paper's 0.03) ramped in by budget_ramp; train/loss logs the
    sum, train/ce_loss and train/budget_loss the two terms (the budget term as added)."""
    budget_norm: Literal["mean", "per_gate"] = "mean"
    """How the budget term counts the gate layers. mean (the paper's literal form, and the lab's
    before): lambda * the mean over the n_layers - 1 gate layers of each layer's mean gate, so one
    gate layer is pulled by lambda / (n_layers - 1): lambda/5 at 6 layers, 2.2x the lambda/11 of
    the paper's 12. per_gate: lambda * the *sum* of the layers' mean gates / (budget_ref_layers -
    1), so one gate layer is pulled by lambda / (budget_ref_layers - 1) at any depth. At n_layers
    = budget_ref_layers = 12 the two are one term: the paper's lambda = 0.03 over its 11 gate
    layers, 0.03/11 = 0.0027 per layer, which per_gate keeps at 2, 6 or 8 layers."""
    budget_ref_layers: int = 12
    """per_gate's reference depth: the depth whose mean-normalised lambda per_gate reproduces (the
    paper's 12 layers, 11 gate layers). Unused with budget_norm=mean."""
    budget_ramp: float = 0.0
    """Share of train.steps over which lambda rises linearly from 0 at step 0 to budget_lambda at
    step budget_ramp * train.steps (then stays): the gates are not pulled down while the model is
    still untrained (a saturated gate, g -> 0, gets no gradient back: g(1 - g) -> 0). 0 = full
    lambda from step 0 (the paper's literal form, and the lab's before)."""
    lr_decay: Literal["none", "cosine"] = "none"
    """The lr after the warmup. none: constant at the peak (the lab's schedule before). cosine:
    from the peak at step warmup_steps down to min_lr_ratio * peak at the last step, train.steps -
    1 (GPT-3's schedule, nanoGPT's; the KV paper states none). The schedule spans train.steps: a
    run extended with a larger train.steps follows the re-stretched curve from its resume step."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay as a fraction of the peak lr (GPT-3: 10%). Unused with
    lr_decay=none."""
    gate_weight_decay: bool = True
    """True (as before): the gates' weight matrices are decayed like every matrix (their biases,
    like every bias, are not). False: every gate parameter, weight and bias, goes in the no-decay
    group, so nothing but the loss moves the gates."""
    init_from: str = ""
    """Start each arm from trained weights instead of the seeded initialisation: a trained run /
    cell directory (its checkpoints/last) or a checkpoint directory itself (with manifest.json).
    The source must be a dense model of the arm's shape (layers, width, heads, d_ff, norms,
    context, vocabulary, position, attention kind); a gated arm's gates start at w = 0, b =
    model.gate_bias_init (g = sigmoid(5) = 0.9933: the dense model up to that factor); the
    optimizer and the schedule start fresh. Read only at a fresh start (a resume loads its own
    checkpoint). "" = the seeded initialisation. An -ft cell sets it to its backbone's directory."""
    finetune_steps: int = 0
    """Steps of each -ft cell of the KV study (the fine-tune controls: sig-g-rope-ft is sig-g-rope
    started from the trained sig-rope of the same run, <out_dir>/<name>/sig-rope/, gates at w = 0,
    b = 5); 0 = train.steps // 4. Each -ft cell runs the recipe over its own steps: warmup_steps
    scaled by finetune_steps / train.steps, the budget ramp and the cosine over finetune_steps.
    Extending a trained -ft cell changes its warmup, so it resumes only with --resume=force."""
    deterministic: bool = False
    """Repeat bit for bit run to run: torch.use_deterministic_algorithms(True) for the run (an op
    without a deterministic kernel stops it, naming the op), one pinned launch config per Triton
    kernel, and deterministic attention in both arms: softmax_backend=auto takes softmax-triton
    (CPU: softmax-reference), sigmoid_backend=auto sigmoid-triton (CPU: sigmoid-reference);
    softmax and softmax-flex are refused. Slower."""

    def __post_init__(self) -> None:
        check_finite(self, "train.")
        _check(self.steps > 0, "train.steps", f"must be positive, got {self.steps}")
        _check(self.global_batch > 0, "train.global_batch", "must be positive")
        _check(self.micro_batch > 0, "train.micro_batch", "must be positive")
        # The process count is known only at launch (the trainer checks micro_batch x processes);
        # this part is known now, so a bad pair stops before any data is read.
        _check(
            self.global_batch % self.micro_batch == 0,
            "train.micro_batch",
            f"global_batch={self.global_batch} is not a multiple of micro_batch={self.micro_batch}",
        )
        _check(self.lr > 0, "train.lr", f"must be positive, got {self.lr}")
        _check(self.lr_scale > 0, "train.lr_scale", f"must be positive, got {self.lr_scale}")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1/beta2", "must be in [0, 1)"
        )
        _check(self.eps > 0, "train.eps", "must be positive")
        _check(
            self.clip_grad is None or self.clip_grad > 0, "train.clip_grad", "must be > 0 or None"
        )
        _check(self.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
        _check(
            self.peak_tflops is None or self.peak_tflops > 0,
            "train.peak_tflops",
            "must be > 0 or None",
        )
        _check(self.budget_lambda >= 0, "train.budget_lambda", "must be >= 0")
        self._check_recipe()
        for key in ("deterministic", "fast", "compile", "group_by_length", "gate_weight_decay"):
            value = getattr(self, key)
            _check(isinstance(value, bool), f"train.{key}", f"must be True or False, got {value!r}")
        _check(
            not (self.fast and self.compile),
            "train.compile",
            "train.fast already compiles the model (fullgraph, with a fallback); leave "
            "train.compile False, or set --train.fast=False to compile alone",
        )
        _check(
            not (self.fast and self.deterministic),
            "train.fast",
            "the compiled step's kernels (inductor's) are not checked to repeat bit for bit, and "
            "train.deterministic is on; set --train.fast=False with --train.deterministic=True",
        )

    def _check_recipe(self) -> None:
        """The budget term's normalisation and ramp, the lr decay, the fine-tune keys."""
        _check_literals(self, "train.", ("budget_norm", "lr_decay"))
        _check(
            isinstance(self.budget_ref_layers, int) and self.budget_ref_layers >= 2,
            "train.budget_ref_layers",
            f"must be an int >= 2 (a depth with at least one gate layer), got "
            f"{self.budget_ref_layers!r}",
        )
        _check(
            0.0 <= self.budget_ramp <= 1.0,
            "train.budget_ramp",
            f"must be in [0, 1] (a share of train.steps), got {self.budget_ramp}",
        )
        _check(
            0.0 <= self.min_lr_ratio <= 1.0,
            "train.min_lr_ratio",
            f"must be in [0, 1] (a fraction of the peak lr), got {self.min_lr_ratio}",
        )
        _check(
            isinstance(self.finetune_steps, int) and self.finetune_steps >= 0,
            "train.finetune_steps",
            f"must be an int >= 0 (0 = train.steps // 4), got {self.finetune_steps!r}",
        )
        _check(
            isinstance(self.init_from, str),
            "train.init_from",
            f"must be a path or '', got {self.init_from!r}",
        )

    @property
    def peak_lr(self) -> float:
        return self.lr * self.lr_scale

    def finetune(self, source: str) -> TrainConfig:
        """The train section of an -ft cell: ``finetune_steps`` steps (0: a quarter of
        ``steps``), the warmup scaled by the same share, starting from ``source``."""
        steps = self.finetune_steps or max(1, self.steps // 4)
        warmup = round(self.warmup_steps * steps / self.steps)
        return dataclasses.replace(self, steps=steps, warmup_steps=warmup, init_from=source)


@dataclass
class TelemetryConfig:
    log_every: int = 10
    """Steps between scalar logs (loss, lr, grad norm, throughput). 0 = off."""
    layer_every: int = 50
    """Steps between per-layer grad/param norms and update-to-weight ratios. 0 = off."""
    logit_every: int = 50
    """Steps between per-layer, per-head max |attention logit|. 0 = off."""
    probe_every: int = 200
    """Steps between live Jacobian spectral-norm probes (0 = off).
    At 200 steps x 256 tokens the measured cost is < 1% of training time (docs/THEORY.md)."""
    probe_samples: int = 1
    """Sequences of the batch the live probe uses."""
    probe_tokens: int = 256
    """Leading tokens of each sampled sequence the live probe uses."""
    probe_iters: int = 8
    """Power iterations per probe."""
    flush_secs: int = 5
    """Seconds between flushes of the TensorBoard event file (what a live viewer sees)."""
    val_every: int = 0
    """Steps between validation passes (data.source=text; 0 = off): mean next-token loss and
    perplexity on fixed windows of the val split, in eval mode, after step 0, every val_every
    steps and after the last step."""
    val_batches: int = 0
    """Validation batches of train.micro_batch windows each: the first ones of the val split, in
    order, the same at every pass (0 = the whole split)."""
    dead_gate_below: float = 1e-3
    """Gated models: a gate layer whose mean gate at the last logged training step (log_every) is
    below this is dead (attention to the next layer switched off); summary.json lists such layers
    as dead_gate_layers (the index of the layer that emits the gate, as gate/mean/layer_{i}) and
    the report flags them. 0 flags none."""

    def __post_init__(self) -> None:
        check_finite(self, "telemetry.")
        for k in (
            "log_every",
            "layer_every",
            "logit_every",
            "probe_every",
            "val_every",
            "val_batches",
        ):
            _check(getattr(self, k) >= 0, f"telemetry.{k}", "must be >= 0")
        _check(self.probe_samples > 0, "telemetry.probe_samples", "must be positive")
        _check(self.probe_tokens > 1, "telemetry.probe_tokens", "must be > 1")
        _check(self.probe_iters > 0, "telemetry.probe_iters", "must be positive")
        _check(self.flush_secs > 0, "telemetry.flush_secs", "must be positive")
        _check(
            0.0 <= self.dead_gate_below < 1.0,
            "telemetry.dead_gate_below",
            f"must be in [0, 1) (a mean gate), got {self.dead_gate_below}",
        )


@dataclass
class StudyConfig:
    """The KV-eviction study's evaluation (``experiments/kv_study.py``); training ignores it."""

    prefill: int = 0
    """Tokens each evaluation window prefills before the decode (0 = half of data.context_len)."""
    window: int = 0
    """Tokens decoded one at a time and scored after the prefill (0 = the rest of the context)."""
    val_windows: int = 0
    """Validation windows of the tau sweep, the first ones of the split in order (0 = all)."""
    test_windows: int = 0
    """Test windows of the frozen tau*, the dense models and the baselines (0 = all)."""
    batch_size: int = 64
    """Windows decoded together (they move in lock step; memory grows with it)."""
    probe_windows: int = 50
    """Test windows the diagnostics (support removal, row-sum CV, gates) read, drawn evenly
    across the split's full windows at an offset seeded by study.seed (all when it has fewer)."""
    probe_ps: tuple[float, ...] = (0.1, 0.3, 0.5)
    """Fractions of K/V positions the random support removal takes out (each in (0, 1))."""
    seed: int = 0
    """Seed of the diagnostics' random draws (the eviction itself draws none)."""
    out_dir: str = ""
    """Where the study's files go ("" = <out_dir>/<name>/study). Cells studied in separate
    processes write separate folders, joined by ``analysis/kv_study.py --merge``."""
    parallel: bool = False
    """Train and study each dense / gated pair of cells (sm-rope with sm-g-rope, ...) in a process
    of its own, all at once on the one GPU, then join their studies into one (how the reduced
    study ran on one H200: four processes, ~11.5 min for the 8 cells). Its processes do not time
    the decode; the parent does, alone on the GPU, after they have all ended (study.timing)."""
    timing: bool = True
    """Time each gated cell's test decode at tau* against tau = 0 (the decode_speed table). The
    parallel mode sets it False in its per-pair processes and times in the parent after them."""
    timing_repeats: int = 3
    """Timed dense / tau* runs per gated cell, alternating; decode_speed reports the median
    seconds and the min / max."""
    tau_rule: Literal["relative", "absolute"] = "relative"
    """How tau* is chosen on validation: the highest-compression tau whose PPL stays within the
    rule of the model's own tau = 0. relative: Delta ln PPL <= study.max_delta_log_ppl (the
    default 0.0045 is the paper's 0.1 PPL at its PPL of 22.4, as a ratio); absolute: Delta PPL <
    study.max_delta_ppl (the paper's literal rule, 0.1)."""
    max_delta_log_ppl: float = 0.0045
    """The relative rule's tolerance on ln PPL(tau) - ln PPL(0)."""
    max_delta_ppl: float = 0.1
    """The absolute rule's tolerance on PPL(tau) - PPL(0) (strictly below)."""
    baselines: tuple[Literal["h2o", "keydiff", "h2o-even", "h2o-final", "keydiff-final"], ...] = (
        "h2o",
        "keydiff",
        "h2o-even",
    )
    """Baselines run on each gated cell's dense backbone at tau*: h2o / keydiff hold at every
    decode step no more entries per layer than the gate held then (step-matched); h2o-even holds
    the gate's total over all layers at each step, spread evenly over the layers; h2o-final /
    keydiff-final the gate's final live count from the prefill on (the lab's earlier matching)."""
    test_sweep: bool = True
    """Also run every tau of the grid on test and report it beside tau* (table sweep_test; it
    selects nothing)."""
    baseline_windows: int = 0
    """Test windows the baselines run on, spread evenly over the split (0 = all the study's test
    windows); their comparisons with the gate use the same windows."""
    bootstrap: int = 2000
    """Resamples of the paired bootstrap behind every interval over windows."""
    heldout_files: list[str] = field(default_factory=list)
    """Text files to score the trained cells on besides the test split (all their tokens, GPT-2
    BPE, tokenised once and cached under data/); tau* stays the one frozen on the training
    corpus's validation split. The tables mark these rows text=heldout."""
    heldout_shards: str = ""
    """A token-shard folder (like data/text, made by experiments/prepare_text.py) whose test split
    is the held-out text; instead of study.heldout_files."""

    def __post_init__(self) -> None:
        check_finite(self, "study.")
        self.probe_ps = tuple(self.probe_ps)  # a list when read back from config.json
        self.baselines = tuple(self.baselines)
        self._check_selection()
        for k in ("prefill", "window", "val_windows", "test_windows", "seed"):
            _check(getattr(self, k) >= 0, f"study.{k}", f"must be >= 0, got {getattr(self, k)}")
        _check(self.batch_size > 0, "study.batch_size", f"must be positive, got {self.batch_size}")
        _check(
            self.timing_repeats >= 1,
            "study.timing_repeats",
            f"must be >= 1 (timed runs per gated cell), got {self.timing_repeats}",
        )
        _check(
            self.probe_windows > 0,
            "study.probe_windows",
            f"must be positive, got {self.probe_windows}",
        )
        _check(bool(self.probe_ps), "study.probe_ps", "needs at least one fraction")
        for p in self.probe_ps:
            _check(
                isinstance(p, (int, float)) and math.isfinite(p),
                "study.probe_ps",
                f"must be a finite number, got {p!r}",
            )
            _check(0.0 < p < 1.0, "study.probe_ps", f"every fraction must be in (0, 1), got {p}")

    def _check_selection(self) -> None:
        """The tau rule, the baselines, the intervals and the held-out text."""
        _check_literals(self, "study.", ("tau_rule",))
        _check(self.max_delta_log_ppl >= 0, "study.max_delta_log_ppl", "must be >= 0")
        _check(self.max_delta_ppl > 0, "study.max_delta_ppl", "must be > 0")
        known = ("h2o", "keydiff", "h2o-even", "h2o-final", "keydiff-final")
        bad = [b for b in self.baselines if b not in known]
        _check(not bad, "study.baselines", f"unknown {bad}; choose from {list(known)}")
        _check(
            len(set(self.baselines)) == len(self.baselines),
            "study.baselines",
            f"repeats a baseline: {list(self.baselines)}",
        )
        _check(self.baseline_windows >= 0, "study.baseline_windows", "must be >= 0")
        _check(
            self.bootstrap >= 100,
            "study.bootstrap",
            f"must be >= 100 resamples for a 95% interval, got {self.bootstrap}",
        )
        _check(
            not (self.heldout_files and self.heldout_shards),
            "study.heldout_shards",
            "give study.heldout_files or study.heldout_shards, not both",
        )

    def decode_split(self, context_len: int) -> tuple[int, int]:
        """``(prefill, window)`` at ``context_len`` with the zeros resolved; the pair must fit
        the context (the decode reads ``prefill + window`` inputs and scores ``window`` tokens)."""
        prefill = self.prefill or context_len // 2
        window = self.window or context_len - prefill
        _check(
            prefill < context_len,
            "study.prefill",
            f"must be < data.context_len={context_len} to leave a window, got {prefill}",
        )
        _check(
            prefill + window <= context_len,
            "study.window",
            f"prefill + window = {prefill} + {window} exceeds data.context_len={context_len}",
        )
        return prefill, window


ARMS = ("softmax", "sigmoid")
"""The stress study's arms (cells data): the attention kind, nothing else changes."""
CELLS = (
    "sm-rope", "sig-rope", "sm-g-rope", "sig-g-rope",
    "sm-nope", "sig-nope", "sm-g-nope", "sig-g-nope",
)  # fmt: skip
"""The KV-eviction study's cells (text data), the paper's SM, Sig, SM+G, Sig+G with RoPE or NoPE:
``{sm|sig}[-g]-{rope|nope}`` = softmax or sigmoid attention, learned gates or none, RoPE or no
position at all. A cell sets model.gates and model.position (:meth:`Config.arm_config`)."""
FT_SUFFIX = "-ft"
FT_CELLS = tuple(f"{c}{FT_SUFFIX}" for c in CELLS if "-g-" in c)
"""The fine-tune controls (not among the default cells; ask for them with --cells): a gated cell
started from its dense backbone's trained weights of the same run, gates at w = 0, b = 5, then
trained ``train.finetune_steps`` steps with the budget term (``TrainConfig.finetune``):
``sig-g-rope-ft`` is gated sigmoid RoPE from ``sig-rope``. The study treats one as a gated cell
with that backbone."""
ALL_CELLS = CELLS + FT_CELLS
"""Every cell name --cells takes."""
CellName = Literal[ALL_CELLS]


def is_finetune(cell: str) -> bool:
    """A fine-tune control (``FT_CELLS``)."""
    return cell in FT_CELLS


def cell_settings(cell: str) -> tuple[str, bool, str]:
    """``(attention kind, gates, position)`` of a cell name: ``sig-g-nope`` (and
    ``sig-g-nope-ft``) -> ``("sigmoid", True, "none")``."""
    if cell not in ALL_CELLS:
        raise ConfigError(f"config cells: unknown cell {cell!r}; choose from {list(ALL_CELLS)}")
    parts = cell.removesuffix(FT_SUFFIX).split("-")
    kind = "softmax" if parts[0] == "sm" else "sigmoid"
    return kind, "g" in parts[1:-1], "rope" if parts[-1] == "rope" else "none"


def backbone_of(cell: str) -> str:
    """The dense cell a gated cell is compared with (and an -ft cell starts from): ``sig-g-rope``
    and ``sig-g-rope-ft`` -> ``sig-rope``; a dense cell is its own."""
    cell_settings(cell)  # refuses an unknown name
    return cell.removesuffix(FT_SUFFIX).replace("-g-", "-")


@dataclass
class Config:
    preset: PresetName = "stress_8k"
    """Preset that sets every default (the list above); --preset NAME --help shows NAME's."""
    name: str = "stress_8k"
    """Run name: runs go to <out_dir>/<name>/<arm>/."""
    out_dir: str = "runs"
    """Folder that holds the runs."""
    arm: Literal["both", "softmax", "sigmoid"] = "both"
    """Stress study (cells data): the attention arm(s) to train; both runs softmax, then sigmoid,
    from the same weights."""
    cells: list[CellName] = field(default_factory=lambda: list(CELLS))
    """KV-eviction study (data.source=text): the cells to train, in this order, from the same
    weights where their parameters coincide and on the same batches; runs go to
    <out_dir>/<name>/<cell>/. {sm|sig}[-g]-{rope|nope}: softmax or sigmoid attention, learned
    gates (-g, the paper's +G) or none, RoPE or NoPE. A cell sets model.gates and model.position.
    The default is the paper's 8. {sm|sig}-g-{rope|nope}-ft: the fine-tune control, the gated cell
    started from its dense backbone's trained weights (train.finetune_steps says how long); the
    backbone must come earlier in the list or be trained already."""
    sigmoid_backend: Literal[
        "auto", "sigmoid-reference", "sigmoid-triton", "sigmoid-triton-exact"
    ] = "auto"
    """auto: sigmoid-triton on CUDA (head dim 64 or 128), else sigmoid-reference.
    sigmoid-triton-exact: the kernel with the exact sigmoid, not the fast tanh.approx one."""
    softmax_backend: Literal[
        "auto", "softmax", "softmax-flex", "softmax-reference", "softmax-triton", "softmax-flash"
    ] = "auto"
    """auto: softmax, or with train.deterministic softmax-triton on CUDA (head dim 64 or 128), else
    softmax-reference.
    softmax: PyTorch SDPA (fast; its GPU backward is not bit-reproducible run to run);
    softmax-flex: FlexAttention (score_mod for the gate bias, block mask for causal + padding);
    softmax-reference: eager n x n (reproducible); softmax-triton: the lab's kernel on the
    sigmoid kernel's skeleton (reproducible); softmax-flash: SDPA's flash kernel alone (no
    padding, no gates; reproducible with train.deterministic)."""
    resume: Literal["auto", "force"] = "auto"
    """auto: continue from <arm dir>/checkpoints/last/ when it exists, refusing a config that
    differs from the checkpoint's in a key that changes training (the error names the keys);
    force: continue anyway and record the change in provenance.json ("resumes")."""
    allow_cpu: bool = False
    """Run a GPU preset on a machine without CUDA anyway (slow; for checks)."""
    report: bool = True
    """Run the analysis report over the arms at the end."""
    fresh: bool = False
    """Start over: delete the arm dirs this command trains (events, summary, checkpoints) first;
    with --arm or --cells only those (the report flags arms of one run whose configs differ)."""
    trackers: list[Literal["wandb", "mlflow"]] = field(default_factory=list)
    """Trackers beside TensorBoard (always on), e.g. --trackers wandb; each must be installed."""
    num_workers: int | None = None
    """DataLoader processes building batches ahead of the step; None: 2 on CUDA, 0 on CPU."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and stress knobs."""
    data: DataConfig = field(default_factory=DataConfig)
    """Cells: synthetic generator or .h5ad file, context length, masking."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer, schedule, batch, precision, checkpoints."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """What is logged and how often."""
    study: StudyConfig = field(default_factory=StudyConfig)
    """KV-eviction study only: decode windows, sweep and test sizes, diagnostics; training
    ignores it (a trained cell resumes whatever these keys say)."""

    def __post_init__(self) -> None:
        _check(
            self.preset in PRESET_NAMES,
            "preset",
            f"unknown preset {self.preset!r}; choose one of {list(PRESET_NAMES)}",
        )
        _check(
            bool(self.name) and "/" not in self.name,
            "name",
            f"must be a plain name, got {self.name!r}",
        )
        # Every section, including any added later, gets the finiteness check.
        check_finite(self, "")
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                check_finite(section, f"{f.name}.")
        self._check_backends()
        self._check_task()
        if self.task == "lm":
            self.study.decode_split(self.data.context_len)

    def _check_task(self) -> None:
        """The model, the arms and validation agree with the task the data implies."""
        lm = self.task == "lm"
        need = (
            "a causal decoder (True): it trains next-token prediction"
            if lm
            else "the bidirectional encoder (False): it trains masked-token prediction"
        )
        _check(
            self.model.causal == lm, "model.causal", f"data.source={self.data.source} needs {need}"
        )
        bad = [c for c in self.cells if c not in ALL_CELLS]
        _check(not bad, "cells", f"unknown cell(s) {bad}; choose from {list(ALL_CELLS)}")
        _check(len(set(self.cells)) == len(self.cells), "cells", f"repeats a cell: {self.cells}")
        for i, cell in enumerate(self.cells):
            backbone = backbone_of(cell) if is_finetune(cell) else None
            _check(
                backbone not in self.cells[i + 1 :],
                "cells",
                f"{cell} starts from {backbone}'s trained weights, and the cells train in order: "
                f"list {backbone} before {cell}",
            )
        if lm:
            _check(bool(self.cells), "cells", "choose at least one cell")
            _check(
                self.arm == "both",
                "arm",
                "picks the stress study's arms; with data.source=text pick cells with --cells",
            )
        else:
            _check(
                list(self.cells) == list(CELLS),
                "cells",
                "picks the KV-eviction study's cells (data.source=text); cells data pair the "
                "arms of --arm",
            )
            _check(
                self.telemetry.val_every == 0,
                "telemetry.val_every",
                "validation reads the val split of data.source=text; cells have none (set 0)",
            )

    def _check_backends(self) -> None:
        """Known backend names (also from a saved config); none that can differ run to run under
        train.deterministic."""
        _check_literals(self, "", ("softmax_backend", "sigmoid_backend"))
        hd = self.model.head_dim
        for key in ("softmax_backend", "sigmoid_backend"):
            name = getattr(self, key)
            _check(
                name not in TRITON_BACKENDS or hd in TRITON_HEAD_DIMS,
                key,
                f"{name!r} runs head dims {TRITON_HEAD_DIMS}, and d_model/n_heads = {hd}; use "
                "auto (the eager reference for this head dim) or another model shape",
            )
        why = NOT_DETERMINISTIC.get(self.softmax_backend)
        _check(
            not (self.train.deterministic and why),
            "softmax_backend",
            f"{self.softmax_backend!r} cannot be deterministic ({why}) and train.deterministic is "
            "on; use auto, softmax-triton, softmax-flash or softmax-reference",
        )

    @property
    def task(self) -> Literal["mlm", "lm"]:
        """mlm: masked tokens of cells, encoder; lm: next tokens of text, causal decoder."""
        return "lm" if self.data.source == "text" else "mlm"

    def arms(self) -> list[str]:
        """The arm names this config trains, in order: cells for text, else the stress arms."""
        if self.task == "lm":
            return list(self.cells)
        return list(ARMS) if self.arm == "both" else [self.arm]

    def attention_of(self, arm: str) -> Literal["softmax", "sigmoid"]:
        """The attention kind of an arm or cell."""
        if arm in ARMS:
            return arm
        return cell_settings(arm)[0]

    def arm_config(self, arm: str) -> Config:
        """The config ``arm`` trains with: this one for a stress arm; for a cell, a copy whose
        model.gates and model.position are the cell's (checked again on the way); for an -ft
        cell also its train section (``TrainConfig.finetune``: its steps, its warmup, init_from
        = its backbone's directory in this run)."""
        if arm in ARMS:
            return self
        _, gates, position = cell_settings(arm)
        train = self.train
        if is_finetune(arm):
            train = train.finetune(os.path.join(self.out_dir, self.name, backbone_of(arm)))
        return dataclasses.replace(
            self, model=dataclasses.replace(self.model, gates=gates, position=position), train=train
        )

    def backend_for(self, arm: str, cuda: bool) -> str:
        """The registered attention backend of an arm or cell on this machine. ``auto`` takes a
        Triton kernel only on CUDA and for a head dim it runs (``TRITON_HEAD_DIMS``), else the
        eager reference (the smoke preset's head dim is 16)."""
        fused = cuda and self.model.head_dim in TRITON_HEAD_DIMS
        if self.attention_of(arm) == "softmax":
            if self.softmax_backend != "auto":
                return self.softmax_backend
            return deterministic_softmax(fused) if self.train.deterministic else "softmax"
        if self.sigmoid_backend == "auto":
            return "sigmoid-triton" if fused else "sigmoid-reference"
        return self.sigmoid_backend


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "telemetry": TelemetryConfig,
    "study": StudyConfig,
}
"""The config's sections by key; a saved config without ``study`` (older runs) gets its defaults."""


def from_dict(d: dict) -> Config:
    sections = {k: cls(**d[k]) for k, cls in SECTIONS.items() if k in d}
    return Config(**{k: v for k, v in d.items() if k not in SECTIONS}, **sections)


def _preset_from_argv(argv: list[str], default: str, study: str | None = None) -> str:
    """The value of the last ``--preset NAME`` / ``--preset=NAME`` (tyro parses it again); with
    ``study``, one of that study's presets."""
    name = default
    for i, a in enumerate(argv):
        if a == "--preset":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("config preset: --preset needs a name")
            name = argv[i + 1]
        elif a.startswith("--preset="):
            name = a.split("=", 1)[1]
    if name not in PRESET_NAMES:
        raise ConfigError(
            f"config preset: unknown preset {name!r}; choose one of {list(PRESET_NAMES)}"
        )
    if study is not None:
        from stabilitylab.study_cli import study_of, study_presets

        if name not in study_presets(study):
            scripts = "experiments/stress_8k.py" if study_of(name) == "stress" else "experiments/kv_eviction.py or kv_study.py"  # fmt: skip
            raise ConfigError(
                f"config preset: {name!r} is the other study's preset (run it with {scripts}); "
                f"this one takes {list(study_presets(study))}"
            )
    return name


def parse(
    argv: list[str] | None = None,
    default_preset: str = "stress_8k",
    *,
    description: str = "",
    study: Literal["stress", "kv"] | None = None,
) -> Config:
    """The config of ``--preset NAME`` (default ``default_preset``) with typed overrides.

    The preset is read first because it sets every default that ``--help`` shows and the
    overrides apply to; tyro then parses the whole line, ``--preset`` included. ``study``: the
    study's presets and keys only (``stabilitylab.study_cli``; the scripts pass theirs), else
    every one. Raises ConfigError naming the key (a bad value, an unknown preset, the other
    study's preset); tyro itself exits with code 2 and a message on an unknown key or a value of
    the wrong type.
    """
    import tyro

    from stabilitylab import study_cli
    from stabilitylab.presets import PRESETS, preset_summary

    argv = list(sys.argv[1:] if argv is None else argv)
    base = PRESETS[_preset_from_argv(argv, default_preset, study)]()
    names = study_cli.study_presets(study) if study else tuple(PRESETS)
    presets = "\n".join(f"  {n:<13} {preset_summary(n)}" for n in names)
    cls = study_cli.cli_type(study) if study else Config
    parsed = tyro.cli(
        cls,
        default=study_cli.as_cli(base, cls) if study else base,
        args=argv,
        prog=os.path.basename(sys.argv[0]),
        description=f"{description or __doc__.splitlines()[0]}\n\nPresets (--preset NAME):\n{presets}",
        use_underscores=True,  # help spells keys as they are typed: --train.micro_batch
        # Booleans take a value like every other key (--model.qk_layernorm=True), not flag pairs.
        config=(tyro.conf.FlagConversionOff,),
    )
    return study_cli.plain(parsed) if study else parsed


def dumps(cfg: Config) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def __getattr__(name: str):
    """The presets live in ``stabilitylab.presets``; ``from stabilitylab.config import smoke``
    (and PRESETS, CPU_PRESETS, preset_summary) still resolve, on first use."""
    from stabilitylab import presets

    if name in presets.__all__:
        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
