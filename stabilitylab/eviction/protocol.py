"""The eviction protocol: decode-window perplexity, compression, the tau sweep and its selection,
and the baselines at a matched final live-cache size.

Decode window (the paper does not give its split; the lab's choice): each evaluation window of
``EvalWindows(split, context_len)`` is cut to its first ``P + W + 1`` tokens; the model prefills
``P`` tokens and decodes ``W`` with teacher forcing, and the window's score is the mean ``-log p``
of the ``W`` tokens the decode steps predict (tokens ``P + 1 .. P + W``). Default ``P = W = 256``
at context 512 (``DecodeSplit.for_context`` halves any context). A window shorter than
``P + W + 1`` tokens (only a split's last one can be) is skipped. PPL = ``exp(sum nll / sum
tokens)`` over all scored tokens of all windows.

Compression = evicted entries / written entries, an entry being one (token, head) row of one
layer's cache, counted at the end of the decode (``P + W`` tokens written per layer): per layer,
and in total over **all** layers (layer 0, which no gate precedes, counts in the denominator: the
paper's "deletes 19.8% of KV entries" is of the whole cache). ``compression_evictable`` counts
layers ``1 .. L-1`` only.

Selection: sweep ``TAU_GRID`` (15 points, below) on the validation split; ``tau*`` = the
highest-compression tau the rule (``TauRule``) accepts against the same model's tau = 0 (ties: the
smaller tau). The default rule is relative: ``ln PPL(tau) - ln PPL(0) <= 0.0045``, the paper's
absolute ``PPL(tau) - PPL(0) < 0.1`` at its PPL of 22 carried to any PPL (``TauRule.paper()``
keeps the absolute form). The guard against selecting on test is structural: ``sweep_tau`` runs
on a ``Split.VAL`` set only, a ``Selection`` derives tau* itself from a validation ``Sweep``,
a gate threshold other than 0 runs on ``Split.TEST`` only through ``evaluate_selected``, which
takes a ``Selection`` (no tau argument) made from the same model, or through ``test_sweep``,
which reports every grid point on test but only once a ``Selection`` has frozen tau*. A test run
in another process than the sweep's (the parallel study times decode speed after its children
wrote the tables) takes a ``RecordedSelection``: the rule applied again to the validation rows
the sweep left in a table, bound to the swept model by its fingerprint.

Baselines: H2O and KeyDiff run on a dense backbone through the same decode loop, with a budget
matched per window and per layer to the gated model's live cache at tau*: the gate keeps ``n_l``
tokens in all ``H`` heads of layer ``l`` (``H n_l`` entries); the baseline keeps ``n_l`` entries in
every head (per-head eviction, the same total ``H n_l``). ``Budget.mode``:

- ``step`` (default): after the prefill and after every decode step the baseline holds at most
  what the gate held then, so it never holds or reads more than the gate at any step (it reads
  exactly as many keys: ``keys_read``);
- ``final``: the gate's *final* count from the prefill on (the lab's earlier rule; during the
  decode the baseline then holds ``min(P + w, n)`` while the gate grows to ``n``);
- ``even``: the gate's total over all layers at each step, spread evenly over the layers (H2O at
  the same total budget without the gate's per-layer allocation).

Layer 0 is matched too (the gate never evicts it). A baseline with the full budget (``P + W`` per
head) evicts nothing and reproduces the dense PPL.

Per window: every ``EvalResult`` keeps each window's NLL sum (``nll_N``), so any PPL or PPL
difference gets a paired bootstrap interval over windows (``stabilitylab.analysis.intervals``).

Speed: ``NoEviction`` and ``GateThreshold`` run through the masked one-pass evaluation
(``masked.py``, equal to the loop up to rounding; ``fast=False`` takes the loop), the budgeted
baselines through the loop.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from stabilitylab.data.text.windows import EvalWindows, TokenSource
from stabilitylab.eviction.decode import check_decoder, decode_nll
from stabilitylab.eviction.masked import masked_decode_nll, supports
from stabilitylab.eviction.policies import CachePolicy, GateThreshold, check_counts
from stabilitylab.model import Transformer

TAU_GRID = (0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
"""The validation grid: dense near 0 where the paper's picks lie (0.01 softmax, 0.05 sigmoid),
then steps of 0.05-0.1 up to 0.8."""
MAX_DELTA_PPL = 0.1
"""The paper's absolute rule: Delta PPL < 0.1 at its PPL of ~22."""
MAX_DELTA_LOG_PPL = 0.0045
"""The default relative rule: Delta ln PPL <= 0.0045 (0.1 / 22.4, the paper's rule as a ratio)."""
BUDGET_MODES = ("step", "final", "even")


class Split(enum.Enum):
    VAL = "val"
    TEST = "test"


@dataclass(frozen=True)
class DecodeSplit:
    prefill: int = 256
    window: int = 256

    def __post_init__(self):
        if self.prefill < 1 or self.window < 1:
            raise ValueError(f"prefill and window must be >= 1, got {self.prefill}, {self.window}")

    @classmethod
    def for_context(cls, context_len: int) -> DecodeSplit:
        """Half prefill, half decode (256 + 256 at context 512)."""
        if context_len < 2:
            raise ValueError(
                f"context_len must be >= 2 for a prefill and a window, got {context_len}"
            )
        return cls(prefill=context_len // 2, window=context_len - context_len // 2)

    @property
    def n_inputs(self) -> int:
        return self.prefill + self.window


@dataclass(frozen=True)
class EvalSet:
    """Evaluation windows tagged with the split they come from."""

    split: Split
    windows: TokenSource

    @classmethod
    def from_shards(cls, shards, split: Split, context_len: int) -> EvalSet:
        """The tag picks the tokens (``shards.val`` / ``shards.test``): they cannot disagree."""
        split = Split(split)
        return cls(split, EvalWindows(shards.split(split.value), context_len, name=split.value))

    def indices(self, decode: DecodeSplit, max_windows: int | None = None) -> list[int]:
        """Windows holding ``P + W + 1`` tokens, in order, at most ``max_windows``."""
        if decode.n_inputs > self.windows.context_len:
            raise ValueError(
                f"prefill + window = {decode.n_inputs} exceeds the windows' context_len "
                f"{self.windows.context_len}"
            )
        n = len(self.windows)
        full = [k for k in range(n) if k < n - 1 or len(self.windows.sample(k)) > decode.n_inputs]
        return full if max_windows is None else full[:max_windows]

    def tokens_BS(self, indices: list[int], decode: DecodeSplit) -> torch.Tensor:
        S = decode.n_inputs + 1
        return torch.from_numpy(np.stack([self.windows.sample(k)[:S] for k in indices]))


def model_fingerprint(model: Transformer) -> str:
    """A short hash of the config and per-parameter sums: tells two trained models apart."""
    sums = torch.stack(
        [torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()]) for p in model.parameters()]
    )  # fmt: skip
    h = hashlib.sha256(repr(model.cfg).encode())
    h.update(sums.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ---- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalResult:
    """One model x policy x split. ``*_NL``: per window (in ``window_indices`` order) and layer."""

    split: Split
    policy: str
    fingerprint: str
    decode: DecodeSplit
    n_heads: int
    window_indices: tuple[int, ...]
    nll_N: np.ndarray
    """Each window's summed ``-log p`` over its ``decode.window`` scored tokens (float64)."""
    n_targets: int
    written_per_layer: int
    """Entries each window wrote into each layer's cache: ``n_heads * (P + W)``."""
    live_NL: np.ndarray
    keys_read_NL: np.ndarray
    bytes_per_entry: int
    """K and V bytes of one entry: ``2 * head_dim * itemsize``."""
    allocated_kv_bytes_L: np.ndarray
    """K/V tensor bytes per layer after the last step, summed over the batches (includes the
    padding slots of a batch whose rows kept different counts; equals the live bytes at B = 1)."""
    live_NSL: np.ndarray | None = None
    """Live entries per window, step (0: after the prefill, ``1 + w``: after decode step ``w``)
    and layer, when asked for (``record_steps``): what a step-matched baseline may hold."""
    budget: str = ""
    """A baseline's budget (``Budget.label``: its mode and source); "" for unbudgeted policies."""

    @property
    def nll_sum(self) -> float:
        return float(self.nll_N.sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.n_targets)

    @property
    def keys_read(self) -> int:
        """Entries the decode steps read, summed over windows, layers, steps and heads."""
        return int(self.keys_read_NL.sum())

    @property
    def evicted_NL(self) -> np.ndarray:
        return self.written_per_layer - self.live_NL

    @property
    def compression_L(self) -> np.ndarray:
        return self.evicted_NL.sum(0) / (self.written_per_layer * len(self.window_indices))

    @property
    def compression(self) -> float:
        """Evicted / written over all layers (the denominator includes layer 0)."""
        return float(self.compression_L.mean())

    @property
    def compression_evictable(self) -> float:
        return float(self.compression_L[1:].mean())

    @property
    def live_kv_bytes_L(self) -> np.ndarray:
        """Bytes of the live K/V entries per layer at the end, mean per window."""
        return self.live_NL.mean(0) * self.bytes_per_entry

    def row(self) -> dict:
        """A flat record for a table (CSV / markdown)."""
        out = {
            "split": self.split.value,
            "policy": self.policy,
            "budget": self.budget,
            "ppl": self.ppl,
            "compression": self.compression,
            "compression_evictable": self.compression_evictable,
            "n_windows": len(self.window_indices),
            "n_targets": self.n_targets,
            "live_kv_bytes_per_window": float(self.live_kv_bytes_L.sum()),
            "keys_read": self.keys_read,
        }
        out.update({f"compression_L{i}": float(c) for i, c in enumerate(self.compression_L)})
        return out


@dataclass(frozen=True)
class LoopOptions:
    """How an evaluation runs (not what it measures)."""

    batch_size: int = 16
    progress: bool = False
    fast: bool = True
    """NoEviction / GateThreshold through the masked one-pass evaluation (``masked.py``)."""
    record_steps: bool = False
    """Keep the per-step live counts (``EvalResult.live_NSL``; a step-matched budget needs them)."""

    @classmethod
    def of(cls, kwargs: dict) -> LoopOptions:
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown arguments {sorted(unknown)}")
        return cls(**kwargs)


def _decode(model, tokens_BS, decode, policy, keep_BSL, fast):
    if fast and keep_BSL is None and supports(policy):
        return masked_decode_nll(model, tokens_BS, decode.prefill, policy)
    return decode_nll(model, tokens_BS, decode.prefill, policy, keep_BSL)


def _batches(indices, opts: LoopOptions, label: str):
    batches = [indices[i : i + opts.batch_size] for i in range(0, len(indices), opts.batch_size)]
    if not opts.progress:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc=label, leave=False)


def _evaluate(model, evalset, policy, decode, keep_NSL, indices, opts: LoopOptions, budget=""):
    fingerprint = model_fingerprint(model)
    nll, live, read, steps, alloc = [], [], [], [], 0
    start = 0
    for idx in _batches(indices, opts, f"{policy.name} {evalset.split.value}"):
        keep = None if keep_NSL is None else torch.from_numpy(keep_NSL[start : start + len(idx)])
        out = _decode(model, evalset.tokens_BS(idx, decode), decode, policy, keep, opts.fast)
        start += len(idx)
        nll.append(out.nll_BW.sum(1).double().cpu().numpy())
        live.append(out.live_BL.cpu().numpy())
        read.append(out.keys_read_BL.cpu().numpy())
        if opts.record_steps:
            steps.append(out.live_BSL.to(torch.int32).cpu().numpy())
        alloc = alloc + np.asarray(out.kv_bytes_L)
    p = next(model.parameters())
    return EvalResult(
        split=evalset.split, policy=policy.name, fingerprint=fingerprint, decode=decode,
        n_heads=model.cfg.n_heads, window_indices=tuple(indices), nll_N=np.concatenate(nll),
        n_targets=len(indices) * decode.window, written_per_layer=out.written_per_layer,
        live_NL=np.concatenate(live), keys_read_NL=np.concatenate(read),
        bytes_per_entry=2 * model.cfg.head_dim * p.element_size(), allocated_kv_bytes_L=alloc,
        live_NSL=np.concatenate(steps) if steps else None, budget=budget,
    )  # fmt: skip


def window_indices_of(evalset, decode, max_windows) -> list[int]:
    """``evalset.indices``, refusing a split with no window long enough for ``decode``."""
    indices = evalset.indices(decode, max_windows)
    if not indices:
        raise ValueError(
            f"no {evalset.split.value} window holds prefill + window + 1 = "
            f"{decode.n_inputs + 1} tokens"
        )
    return indices


def evaluate(
    model: Transformer,
    evalset: EvalSet,
    policy: CachePolicy,
    decode: DecodeSplit | None = None,
    *,
    batch_size: int = 16,
    max_windows: int | None = None,
    **options,
) -> EvalResult:
    """Decode-window PPL and compression of ``model`` under ``policy`` (no budget). A gate
    threshold above 0 on the test split runs only through ``evaluate_selected``. ``options``:
    ``LoopOptions`` (progress, fast, record_steps)."""
    check_decoder(model)
    if evalset.split is Split.TEST and isinstance(policy, GateThreshold) and policy.tau != 0:
        raise ValueError(
            f"{policy.name} on the test split: test runs at the tau* frozen on validation; "
            "use evaluate_selected(model, test_set, select_tau(sweep_tau(model, val_set)))"
        )
    if policy.needs_budget:
        raise ValueError(f"{policy.name} needs a budget: use evaluate_baseline")
    decode = decode or DecodeSplit.for_context(evalset.windows.context_len)
    indices = window_indices_of(evalset, decode, max_windows)
    opts = LoopOptions.of({"batch_size": batch_size, **options})
    return _evaluate(model, evalset, policy, decode, None, indices, opts)


# ---- the tau sweep and its selection ----------------------------------------------------------


def check_grid(grid) -> tuple[float, ...]:
    taus = tuple(GateThreshold(t).tau for t in grid)  # names a bool, NaN, or tau outside [0, 1]
    if 0.0 not in taus:
        raise ValueError(f"the tau grid must contain 0 (the model's own reference), got {taus}")
    if len(set(taus)) != len(taus):
        raise ValueError(f"the tau grid repeats a value: {taus}")
    return tuple(sorted(taus))


@dataclass(frozen=True)
class TauRule:
    """Which taus count as "no loss" against the model's own tau = 0.

    ``relative`` (default): ``ln PPL(tau) - ln PPL(0) <= max_delta`` with ``max_delta`` =
    ``MAX_DELTA_LOG_PPL`` (0.0045, the paper's 0.1 at its PPL of 22.4). ``absolute`` (the paper's
    literal rule): ``PPL(tau) - PPL(0) < max_delta`` with ``max_delta`` = 0.1. A NaN PPL is never
    accepted."""

    kind: str = "relative"
    max_delta: float = MAX_DELTA_LOG_PPL

    def __post_init__(self):
        if self.kind not in ("relative", "absolute"):
            raise ValueError(f"tau rule kind must be relative or absolute, got {self.kind!r}")
        if not (isinstance(self.max_delta, (int, float)) and math.isfinite(self.max_delta)):
            raise ValueError(f"tau rule max_delta must be a finite number, got {self.max_delta!r}")
        if self.max_delta < 0:
            raise ValueError(f"tau rule max_delta must be >= 0, got {self.max_delta}")

    @classmethod
    def paper(cls) -> TauRule:
        return cls("absolute", MAX_DELTA_PPL)

    def accepts(self, ppl: float, ref: float) -> bool:
        if self.kind == "absolute":
            return ppl - ref < self.max_delta
        if not (ppl > 0 and ref > 0):
            return False
        return math.log(ppl) - math.log(ref) <= self.max_delta

    def describe(self) -> str:
        if self.kind == "absolute":
            return f"Delta PPL < {self.max_delta:g}"
        return f"Delta ln PPL <= {self.max_delta:g}"


def select_tau_index(
    taus: list[float],
    ppl: list[float],
    compression: list[float],
    max_delta: float = MAX_DELTA_PPL,
    *,
    rule: TauRule | None = None,
) -> int:
    """Among the taus the rule accepts, the index of the one with the highest compression (ties:
    the smaller tau). ``rule`` None: the paper's absolute rule ``ppl - ppl(tau = 0) <
    max_delta``. Pure; ``taus`` must contain 0. When even tau = 0 is not accepted (its PPL is
    NaN), tau = 0's index."""
    if 0.0 not in taus:
        raise ValueError("select_tau_index needs tau = 0 among the taus")
    rule = rule if rule is not None else TauRule("absolute", max_delta)
    i0 = taus.index(0.0)
    ok = [i for i in range(len(taus)) if rule.accepts(ppl[i], ppl[i0])]
    if not ok:
        return i0
    return max(ok, key=lambda i: (compression[i], -taus[i]))


@dataclass(frozen=True)
class Sweep:
    split: Split
    fingerprint: str
    taus: tuple[float, ...]
    results: tuple[EvalResult, ...]

    def rows(self) -> list[dict]:
        ref = self.results[self.taus.index(0.0)].ppl
        return [
            {"tau": t, **r.row(), "delta_ppl": r.ppl - ref}
            for t, r in zip(self.taus, self.results, strict=True)
        ]


def sweep_tau(
    model: Transformer,
    val_set: EvalSet,
    grid=TAU_GRID,
    decode: DecodeSplit | None = None,
    **kwargs,
) -> Sweep:
    """Decode-window PPL and compression at every tau of ``grid``, on validation windows only.
    ``kwargs`` go to ``evaluate`` (batch_size, max_windows, progress)."""
    if val_set.split is not Split.VAL:
        raise ValueError(f"tau is swept on the validation split only, got {val_set.split.value}")
    if not model.cfg.gates:
        raise ValueError("sweep_tau needs a gated model (model.gates=True)")
    taus = check_grid(grid)
    results = tuple(evaluate(model, val_set, GateThreshold(t), decode, **kwargs) for t in taus)
    return Sweep(Split.VAL, results[0].fingerprint, taus, results)


@dataclass(frozen=True)
class Selection:
    """tau* of one model, derived from its validation sweep (the constructor applies the rule)."""

    sweep: Sweep
    rule: TauRule = TauRule()
    tau: float = field(init=False)

    def __post_init__(self):
        if self.sweep.split is not Split.VAL:
            raise ValueError(
                f"tau* is selected on validation only, got a {self.sweep.split.value} sweep"
            )
        taus = self.sweep.taus
        i = select_tau_index(
            list(taus),
            [r.ppl for r in self.sweep.results],
            [r.compression for r in self.sweep.results],
            rule=self.rule,
        )
        object.__setattr__(self, "tau", taus[i])

    @property
    def fingerprint(self) -> str:
        return self.sweep.fingerprint

    @property
    def val_result(self) -> EvalResult:
        return self.sweep.results[self.sweep.taus.index(self.tau)]

    @property
    def decode(self) -> DecodeSplit:
        return self.val_result.decode


@dataclass(frozen=True)
class RecordedSelection:
    """tau* of one model re-derived from its validation sweep as recorded in a table (tau, PPL,
    compression per grid point: a study's table5 rows), for a test run in another process. The
    constructor applies the rule itself, so the recorded numbers can only be validation ones and
    tau* is never a free argument; ``fingerprint`` (``model_fingerprint`` of the swept model)
    binds it to that model, ``decode`` is the sweep's split."""

    fingerprint: str
    decode: DecodeSplit
    taus: tuple[float, ...]
    ppl: tuple[float, ...]
    compression: tuple[float, ...]
    rule: TauRule = TauRule()
    tau: float = field(init=False)

    def __post_init__(self):
        taus = check_grid(self.taus)
        if taus != tuple(float(t) for t in self.taus):
            raise ValueError(f"the recorded sweep's taus must be sorted, got {self.taus}")
        if not len(self.taus) == len(self.ppl) == len(self.compression):
            raise ValueError(
                f"the recorded sweep has {len(self.taus)} taus, {len(self.ppl)} PPLs and "
                f"{len(self.compression)} compressions"
            )
        i = select_tau_index(list(taus), list(self.ppl), list(self.compression), rule=self.rule)
        object.__setattr__(self, "tau", taus[i])


def select_tau(sweep: Sweep, rule: TauRule | None = None) -> Selection:
    return Selection(sweep, rule if rule is not None else TauRule())


def _check_selection(model, test_set, selection) -> None:
    if not isinstance(selection, (Selection, RecordedSelection)):
        raise ValueError(
            "evaluate_selected needs a Selection from select_tau (or a RecordedSelection of a "
            f"recorded validation sweep), got {type(selection)}"
        )
    if test_set.split is not Split.TEST:
        raise ValueError(f"evaluate_selected runs on the test split, got {test_set.split.value}")
    if model_fingerprint(model) != selection.fingerprint:
        raise ValueError("this tau* was selected on another model (fingerprints differ)")


def evaluate_selected(
    model: Transformer, test_set: EvalSet, selection: Selection | RecordedSelection, **kwargs
) -> EvalResult:
    """The gated model on test at its frozen tau*, with the validation sweep's decode split.
    ``kwargs``: max_windows and ``LoopOptions`` (batch_size, progress, fast, record_steps)."""
    _check_selection(model, test_set, selection)
    decode = selection.decode
    indices = window_indices_of(test_set, decode, kwargs.pop("max_windows", None))
    policy = GateThreshold(selection.tau)
    return _evaluate(model, test_set, policy, decode, None, indices, LoopOptions.of(kwargs))


def test_sweep(
    model: Transformer, test_set: EvalSet, selection: Selection | RecordedSelection, **kwargs
) -> Sweep:
    """Every grid point of the validation sweep on test, *reported* beside the frozen tau*
    (the test curve of Figure 1): it runs only once a selection exists and selects nothing."""
    _check_selection(model, test_set, selection)
    taus = selection.sweep.taus if isinstance(selection, Selection) else selection.taus
    decode = selection.decode
    indices = window_indices_of(test_set, decode, kwargs.pop("max_windows", None))
    opts = LoopOptions.of(kwargs)
    results = tuple(
        _evaluate(model, test_set, GateThreshold(t), decode, None, indices, opts) for t in taus
    )
    return Sweep(Split.TEST, results[0].fingerprint, tuple(taus), results)


test_sweep.__test__ = False  # a protocol step, not a pytest test


# ---- baselines at a matched budget ------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """Live entries (summed over heads) a baseline may hold, per window and layer, from a gated
    model's run: ``live_NSL`` per step (0: after the prefill, ``1 + w``: after decode step ``w``)
    for ``mode`` step and even, ``live_NL`` (final) for mode final (module docstring)."""

    split: Split
    decode: DecodeSplit
    window_indices: tuple[int, ...]
    live_NL: np.ndarray
    source: str
    mode: str = "final"
    live_NSL: np.ndarray | None = None

    def __post_init__(self):
        if self.mode not in BUDGET_MODES:
            raise ValueError(f"budget mode must be one of {BUDGET_MODES}, got {self.mode!r}")
        if self.mode != "final" and self.live_NSL is None:
            raise ValueError(f"a {self.mode} budget needs the gate's per-step live counts")
        check_counts(self.live_NL, "budget live_NL")  # whole entries: no NaN, no fraction
        if self.live_NSL is not None:
            check_counts(self.live_NSL, "budget live_NSL")

    @property
    def label(self) -> str:
        return f"{self.mode}-matched to {self.source}"

    def keep_per_head(self, n_heads: int) -> np.ndarray:
        """Entries each head keeps: ``(N, L)`` (mode final) or ``(N, S, L)``, rounded down."""
        if self.mode == "final":
            return (self.live_NL // n_heads).astype(np.int64)
        live_NSL = self.live_NSL.astype(np.int64)
        if self.mode == "even":
            L = live_NSL.shape[2]
            live_NSL = np.repeat(live_NSL.sum(2, keepdims=True) // L, L, axis=2)
        return live_NSL // n_heads

    def keep_per_head_NL(self, n_heads: int) -> np.ndarray:
        """The largest per-head budget of each window and layer over the steps."""
        keep = self.keep_per_head(n_heads)
        return keep if keep.ndim == 2 else keep.max(1)


def matched_budget(gate_result: EvalResult, mode: str = "step") -> Budget:
    """``gate_result``'s live cache as a budget for the baselines (``Budget.mode``); a step or
    even budget needs a gate run with ``record_steps=True``."""
    if mode != "final" and gate_result.live_NSL is None:
        raise ValueError(
            f"a {mode}-matched budget needs the gate's per-step live counts: evaluate the gate "
            "with record_steps=True"
        )
    return Budget(
        split=gate_result.split,
        decode=gate_result.decode,
        window_indices=gate_result.window_indices,
        live_NL=gate_result.live_NL.copy(),
        source=gate_result.policy,
        mode=mode,
        live_NSL=None if mode == "final" else gate_result.live_NSL,
    )


def check_budget(model: Transformer, evalset: EvalSet, budget: Budget) -> np.ndarray:
    """The per-head budget the loop takes (``Budget.keep_per_head``), refusing a budget of
    another split, layer count or a size beyond the sequence, naming the window and layer."""
    if budget.split is not evalset.split:
        raise ValueError(
            f"budget from the {budget.split.value} split used on {evalset.split.value} windows"
        )
    L = model.cfg.n_layers
    if budget.live_NL.shape[1] != L:
        raise ValueError(f"budget has {budget.live_NL.shape[1]} layers, the model has {L}")
    keep = budget.keep_per_head(model.cfg.n_heads)
    keep_NL = keep if keep.ndim == 2 else keep.max(1)
    if keep_NL.max() > budget.decode.n_inputs:
        n, layer = np.argwhere(keep_NL > budget.decode.n_inputs)[0]
        raise ValueError(
            f"baseline budget of {keep_NL[n, layer]} entries per head (window "
            f"{budget.window_indices[n]}, layer {layer}) exceeds the sequence's "
            f"{budget.decode.n_inputs} tokens"
        )
    return keep


def evaluate_baseline(
    dense_model: Transformer, evalset: EvalSet, policy: CachePolicy, budget: Budget, **kwargs
) -> EvalResult:
    """A budgeted policy (H2O, KeyDiff) on the budget's windows, each window at its own
    per-layer (and, for step / even budgets, per-step) budget. ``kwargs``: ``LoopOptions``."""
    check_decoder(dense_model)
    if not policy.needs_budget:
        raise ValueError(f"{policy.name} keeps no budget: use evaluate")
    keep = check_budget(dense_model, evalset, budget)
    indices = list(budget.window_indices)
    if not set(indices) <= set(evalset.indices(budget.decode)):
        raise ValueError("the budget's windows are not this evaluation set's windows")
    opts = LoopOptions.of(kwargs)
    return _evaluate(dense_model, evalset, policy, budget.decode, keep, indices, opts, budget.label)


def full_budget(evalset: EvalSet, n_layers: int, n_heads: int, decode: DecodeSplit, **kw) -> Budget:
    """Every entry kept (zero budget reduction): a baseline then equals the dense run."""
    indices = window_indices_of(evalset, decode, kw.get("max_windows"))
    live_NL = np.full((len(indices), n_layers), n_heads * decode.n_inputs, dtype=np.int64)
    return Budget(evalset.split, decode, tuple(indices), live_NL, "full")
