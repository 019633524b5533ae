"""Shared plumbing for the Triton kernels: interpreter switch, input validation, autotune keys.

Triton decides between compiling and interpreting when ``@triton.jit`` runs, i.e. at import, from
``TRITON_INTERPRET``. The launchers here re-decide at every call instead: the same raw function is
wrapped as an ``InterpretedFunction`` when ``TRITON_INTERPRET=1`` is set *now*. The interpreter
still needs ``TRITON_INTERPRET=1`` from before triton's import (``interpreter_available``: Triton's
own jit helpers are built then); tests on a GPU host run the interpreter cases in a process of
their own (tests/conftest.py).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import weakref

import torch
import triton
import triton.language as tl

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def interpreting() -> bool:
    """Read at call time, never cached: tests flip it inside one process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_available() -> bool:
    """Whether Triton's CPU interpreter can run kernels in this process. Only if
    ``TRITON_INTERPRET=1`` was set before triton was imported: Triton builds its own jit helpers
    (``tl.max``, ``tl.cdiv``, ...) once, at import, as interpreter or compiled functions, and an
    interpreted kernel cannot call compiled ones."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


@functools.cache
def interpreted(kernel):
    """The interpreter twin of a ``@triton.jit`` kernel (built once per kernel)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    return InterpretedFunction(kernel.fn)


@functools.cache
def compiled(kernel):
    """The compiling twin, for a module that was imported while ``TRITON_INTERPRET=1`` was set."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: ``triton.cdiv`` costs ~4 us per call (triton 3.9, the CI
    machine), and launchers call it on every launch."""
    return -(-a // b)


def seq_bucket(T: int) -> int:
    """Autotune key for the sequence length: next power of two, so nearby T share a config."""
    # Plain int arithmetic: triton.next_power_of_2 costs ~3 us per host call (triton 3.9, CPU).
    return 1 << (max(int(T), 16) - 1).bit_length()


def specialization(*values) -> tuple:
    """What Triton compiles a kernel for beyond the autotune key: per pointer, whether it is
    16-byte aligned; per integer, whether it is 1 or divisible by 16 (its JIT specialises on
    both). A config chosen under one specialisation may not run under another: on the H200 a
    forward config tuned on aligned inputs asked for 262,144 bytes of shared memory (232,448
    allowed) on inputs with a row stride of 129, so each specialisation is autotuned on its own."""
    spec = []
    for x in values:  # on every launch: type tests first (~5 us for 24 values on the CI CPU)
        kind = type(x)
        if kind is int:
            spec.append(1 if x == 1 else 16 if not x & 15 else 0)
        elif kind is not float and kind is not bool and isinstance(x, torch.Tensor):
            spec.append(not x.data_ptr() & 15)
    return tuple(spec)


@functools.cache
def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel at most: one per SM on a GPU; three in the interpreter, so
    that each program loops over several tiles there too."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_grid(n_tiles: int, device: torch.device) -> int:
    """Programs for ``n_tiles`` equal tiles: the fewest that take them in as few rounds as
    ``persistent_programs`` would. 2,048 tiles on 132 SMs need 16 rounds, and 128 programs do
    them in 16 full rounds; the idle SMs leave the others more of the board's power cap, which
    sets the clock of these kernels on an H200 (docs/BENCHMARKS.md)."""
    rounds = cdiv(n_tiles, persistent_programs(device))
    return cdiv(n_tiles, rounds)


@triton.jit
def max_abs_bits(mx_bits, s):
    """Running row max of |s| for a (BLOCK_M, BLOCK_N) float32 tile ``s``, held as int32 bits
    (``mx_bits`` starts from ``tl.zeros((BLOCK_M,), tl.int32)``). The bits of a non-negative float
    order as int32 as the floats do, and a NaN's lie above +inf's, so the integer max keeps a NaN
    where Triton's float max (``tl.max``, ``tl.maximum``) drops it: a max|logit| telemetry must
    report the NaN it exists to catch."""
    return tl.maximum(mx_bits, tl.max(s.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))


@triton.jit
def bits_as_max(mx_bits):
    """The float32 maximum of ``max_abs_bits``' rows (NaN if any row saw one)."""
    return tl.max(mx_bits, axis=0).to(tl.float32, bitcast=True)


@functools.cache  # on every launch; torch's lookup costs ~10 us of host time
def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


class Tuned:
    """A kernel autotuned over ``configs`` at the first call per ``key``, then launched straight
    with the config chosen: Triton's autotuner dispatch costs ~30 us of host time per call on the
    H200 host (docs/BENCHMARKS.md), which a timed call counts whenever the GPU waits for it.

    ``tuned.launch(grid, key, *args, **kwargs)``; ``key`` must determine the autotuner's own key
    (its ``key_names`` values); ``cache`` and ``base_fn`` mirror the autotuner's, for
    ``autotune_choices``. A config's ``pre_hook`` runs before straight launches too, on the
    keyword arguments and the config's."""

    def __init__(self, kernel, configs, key_names: list[str]):
        self.jit = compiled(kernel)
        self.tuner = triton.autotune(configs=list(configs), key=key_names)(self.jit)
        self._best: dict[tuple, dict] = {}
        # The chosen config's pre-hook, which straight launches run as the tuner runs it.
        self._hook: dict[tuple, object] = {}

    @property
    def cache(self) -> dict:
        return self.tuner.cache

    @property
    def base_fn(self):
        return self.tuner.base_fn

    def launch(self, grid, key: tuple, *args, **kwargs) -> None:
        best = self._best.get(key)
        if best is None:
            self.tuner[grid](*args, **kwargs)
            chosen = getattr(self.tuner, "best_config", None)  # set by every autotuner run
            if chosen is not None:
                self._best[key] = chosen.all_kwargs()
                self._hook[key] = chosen.pre_hook
        else:
            hook = self._hook.get(key)
            if hook is not None:  # sees the keyword arguments and the config's (the dense
                hook({**kwargs, **best})  # kernels' descriptors are keyword arguments)
            self.jit[grid](*args, **kwargs, **best)


def check_attention_inputs(
    named: dict[str, torch.Tensor],
    lengths_B: torch.Tensor,
    scale: float | None,
    bias: float | None = None,
    causal: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first problem with ``q/k/v_BHTD`` and ``lengths_B``.

    Checks rank, matching shapes, head dim, dtypes, devices, CPU-without-interpreter, scale,
    bias, causal (a bool), and the lengths' shape, dtype and range [1, T]. The range check costs
    one device sync per new lengths tensor; it is skipped while ``torch.compile`` traces (a
    data-dependent branch breaks the graph), and made again at launch
    (``check_lengths_at_launch``).
    """
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (B, H, T, D), got shape {tuple(t.shape)}")
        if t.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {first_name} {tuple(first.shape)} vs {name} {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} has unsupported dtype {t.dtype}; use one of {SUPPORTED_DTYPES}"
            )
        if t.dtype != first.dtype:
            raise ValueError(f"dtype mismatch: {first_name} {first.dtype} vs {name} {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"device mismatch: {first_name} {first.device} vs {name} {t.device}")
    B, _, T, D = first.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"unsupported head dim D={D}; supported: {SUPPORTED_HEAD_DIMS}")
    if first.device.type == "cpu" and not interpreting():
        raise ValueError(
            "inputs are CPU tensors but TRITON_INTERPRET is not '1'; move them to CUDA or set "
            "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter"
        )
    if first.device.type == "cpu" and not interpreter_available():
        raise ValueError(
            "inputs are CPU tensors and TRITON_INTERPRET=1, but it was set after triton was "
            "imported, so Triton's CPU interpreter cannot run here; set it before starting Python"
        )
    if first.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"unsupported device {first.device}; use cuda (or cpu with the interpreter)"
        )
    if not isinstance(lengths_B, torch.Tensor):
        raise ValueError(f"lengths_B must be a torch.Tensor, got {type(lengths_B).__name__}")
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths_B must have shape (B,) = ({B},), got {tuple(lengths_B.shape)}")
    if lengths_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths_B must be int32 or int64, got {lengths_B.dtype}")
    if lengths_B.device != first.device:
        raise ValueError(
            f"device mismatch: {first_name} {first.device} vs lengths_B {lengths_B.device}"
        )
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # numpy floats too
    if scale is not None and not (real(scale) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if bias is not None and not (real(bias) and math.isfinite(bias)):
        raise ValueError(f"bias must be a finite float or None, got {bias!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if B == 0 or T == 0:
        raise ValueError(f"empty input: B={B}, T={T}")
    if not torch.compiler.is_compiling():
        _lengths_min_max(lengths_B, T)


def check_key_bias(
    q_BHTD: torch.Tensor,
    key_bias_BT: torch.Tensor | None,
    key_bias_BHT: torch.Tensor | None,
    prefix: str = "key_bias",
) -> torch.Tensor | None:
    """The per-key logit bias as the kernels take it, or None: a (B, H, T) float32 tensor with unit
    stride along T; ``key_bias_BT`` expanded over the heads (a view, so autograd sums its per-head
    gradient over them), ``key_bias_BHT`` as is. Raise ``ValueError`` naming the argument: both
    given, not a tensor, wrong shape, dtype or device. ``prefix``: the arguments' names (``gate``
    for the fused gate, ``gate_BT`` / ``gate_BHT``, which the kernels take the same way)."""
    if key_bias_BT is not None and key_bias_BHT is not None:
        raise ValueError(f"pass {prefix}_BT or {prefix}_BHT, not both")
    B, H, T, _ = q_BHTD.shape
    for name, kb, shape in ((f"{prefix}_BT", key_bias_BT, (B, T)),
                            (f"{prefix}_BHT", key_bias_BHT, (B, H, T))):  # fmt: skip
        if kb is None:
            continue
        if not isinstance(kb, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(kb).__name__}")
        if tuple(kb.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(kb.shape)}")
        if kb.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{name} has unsupported dtype {kb.dtype}; use one of {SUPPORTED_DTYPES}"
            )
        if kb.device != q_BHTD.device:
            raise ValueError(f"device mismatch: q_BHTD {q_BHTD.device} vs {name} {kb.device}")
        kb = kb.float()
        if kb.stride(-1) != 1:
            kb = kb.contiguous()
        return kb[:, None, :].expand(B, H, T) if kb.dim() == 2 else kb
    return None


class LastTensorMemo:
    """One answer about the last tensor asked about, reused while that same tensor (weakly held)
    is unchanged (its version counter: in-place writes bump it) and ``key`` is equal. For host
    reads of a tensor a model passes to every layer, where a sync per call would stall the launch
    queue (docs/LOG.md, 2026-11-29). Inference tensors have no version counter: never cached."""

    def __init__(self) -> None:
        self._seen: tuple[weakref.ref, int, object, object] | None = None

    def get(self, t: torch.Tensor, key, compute):
        cacheable = not t.is_inference()
        if cacheable and self._seen is not None:
            ref, version, seen_key, value = self._seen
            if ref() is t and version == t._version and seen_key == key:
                return value
        value = compute()  # an exception leaves nothing cached
        if cacheable:
            self._seen = (weakref.ref(t), t._version, key, value)
        return value


_lengths_in_range = LastTensorMemo()


def _lengths_min_max(lengths_B: torch.Tensor, T: int) -> tuple[int, int]:
    """``(min, max)`` of the lengths, checked to lie in [1, T]: one sync per new lengths tensor."""

    def read() -> tuple[int, int]:
        lo, hi = torch.stack(torch.aminmax(lengths_B)).tolist()  # one sync, not two
        if lo < 1 or hi > T:
            raise ValueError(f"lengths_B must lie in [1, T={T}], got min {lo}, max {hi}")
        return lo, hi

    return _lengths_in_range.get(lengths_B, T, read)


def _capturing(lengths_B: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the lengths' stream (no host read allowed)."""
    return lengths_B.is_cuda and torch.cuda.is_current_stream_capturing()


def check_lengths_at_launch(lengths_B: torch.Tensor, T: int) -> None:
    """The lengths' range check again where the kernels are launched, for calls whose validation
    skipped it (``torch.compile`` traces without it; the compiled graph then calls the op with
    any lengths). From the memo: free when validation has just read the same tensor, else one
    sync. Not while a CUDA graph is captured: a sync is an error there."""
    if not _capturing(lengths_B):
        _lengths_min_max(lengths_B, T)


def lengths_all_full(lengths_B: torch.Tensor, T: int) -> bool:
    """Whether no sequence is padded (every L_b == T), from the range check's memo (a lengths
    tensor not seen yet is read: one sync; inference tensors, which the memo cannot hold, every
    time). Never while a CUDA graph is being captured: a sync is an error there, and a graph is
    replayed with whatever lengths its static buffer holds then, which only the kernels that read
    the lengths on the device (those for padded batches) handle."""
    return not _capturing(lengths_B) and _lengths_min_max(lengths_B, T)[0] == T


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take any (b, h, t) strides but need unit stride along D for wide loads."""
    return t if t.stride(-1) == 1 else t.contiguous()


def autotune_choices(tuned: dict) -> dict[str, str]:
    """What each autotuner in ``tuned`` (a launcher cache: any key -> ``triton.autotune`` object)
    chose so far: ``"kernel_name[key values]" -> "BLOCK_M: 128, ..., num_stages: 3"``. Empty in
    the interpreter, which does not autotune. Recorded in every run's provenance."""
    out = {}
    for tuner in tuned.values():
        fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
        name = getattr(fn, "__name__", type(tuner).__name__)
        for key, config in getattr(tuner, "cache", {}).items():
            out[f"{name}{list(key)}"] = str(config)
    return out
