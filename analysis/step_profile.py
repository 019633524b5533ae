"""Where a training step's time goes: profiler kernels -> buckets -> a table (pure maths).

``experiments/bench/profile_step.py`` runs a few warmed-up steps under ``torch.profiler`` and hands
the kernels here. Each kernel (CUDA: its demangled name, the aten op that launched it, the step
phase it ran in; CPU: each aten op's self time) goes to one bucket of ``BUCKETS`` by
``kernel_bucket``; the idle/host gap is the step's wall time minus the summed kernel time, so the
buckets of a step add up to its wall time by construction. A gap below zero (beyond
``GAP_TOLERANCE`` of the step) means the kernels were counted wrong (a range that is no kernel,
such as a ``record_function`` phase projected onto the GPU, or kernels overlapping on several
streams): ``summarise`` refuses it rather than print buckets that do not add up.

Rules, first match wins: attention kernels (ours, flash, cuDNN, memory-efficient) by phase of
the name (fwd / bwd); every GEMM (cuBLAS sm90/nvjet/cutlass, gemv, split-K reduce, inductor mm
templates) to ``gemm`` wherever it runs; then anything launched inside the ``loss`` or
``optimizer`` phase (a chunked cross-entropy's softmax, the grad norm, ``found_inf``) to that
phase; then names: norms, GELU, dropout, embedding, cross-entropy, optimizer, copies and casts,
generic elementwise / reductions (``elementwise``), and the rest to ``other``, whose largest
kernels the table lists so that nothing uncategorised hides. Inductor's fused kernels
(``triton_poi_fused_native_layer_norm_gelu_...``) take the first bucket in that order whose op
their name carries.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass, field

ATTN_FWD, ATTN_BWD = "attention fwd", "attention bwd"
GEMM, NORM, ACT, DROPOUT, EMBED = "gemm", "norm", "activation (GELU)", "dropout", "embedding"
LOSS, OPTIM, COPY = "loss (CE)", "optimizer", "copy/cast/transpose"
ELEMENTWISE, OTHER, IDLE = "elementwise (other)", "other (uncategorised)", "idle/host gap"
BUCKETS = (
    ATTN_FWD, ATTN_BWD, GEMM, NORM, ACT, DROPOUT, EMBED, LOSS, OPTIM, COPY, ELEMENTWISE, OTHER, IDLE,
)  # fmt: skip
PHASES = ("forward", "loss", "backward", "optimizer")
"""The ``record_function`` names a profiled step marks its phases with."""

_ATTN_FWD = (
    "_sigmoid_fwd", "_softmax_fwd", "_max_abs_logit", "flash_fwd", "fmha_cutlassf", "fmha_fwd",
    "flash_fprop", "sdpa_fprop", "attention_forward", "scaled_dot_product", "flex_attention",
)  # fmt: skip
_ATTN_BWD = (
    "_sigmoid_bwd", "_softmax_bwd", "flash_bwd", "fmha_cutlassb", "fmha_bwd", "flash_bprop",
    "sdpa_bprop", "attention_backward", "flex_attention_backward",
)  # fmt: skip
_GEMM = (
    "gemm", "nvjet", "gemv", "splitkreduce", "cutlass", "xmma", "cublas", "triton_tem_fused_mm",
    "triton_tem_fused_addmm", "triton_tem_fused_bmm", "aten::mm", "aten::addmm", "aten::bmm",
    "aten::matmul", "aten::linear", "aten::baddbmm",
)  # fmt: skip
# By name, in this order (fused inductor kernels carry several op names).
_BY_NAME = (
    (LOSS, ("nll_loss", "logsoftmax", "log_softmax", "cross_entropy", "logsumexp")),
    (OPTIM, ("fusedadam", "fused_adam", "adamw", "lpnormfunctor", "lpnorm_cleanup", "_foreach")),
    (NORM, ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "gammabetabackward")),
    (ACT, ("gelu",)),
    (DROPOUT, ("dropout", "masked_scale", "bernoulli", "inductor_random", "inductor_seeds")),
    (
        EMBED,
        (
            "embedding",
            "indexselect",
            "index_select",
            "krn_partials_per_segment",
            "krn_partial_segment_offset",
            "compute_grad_weight",
            "sum_and_scatter",
            "compute_num_of_partial_segments",
            "radixsort",
        ),
    ),  # fmt: skip
    (
        COPY,
        (
            "copy_kernel",
            "catarraybatchedcopy",
            "memcpy",
            "transpose",
            "permute",
            "aten::copy_",
            "aten::clone",
            "aten::contiguous",
            "aten::cat",
            "aten::stack",
            "aten::_to_copy",
            "to_copy",
        ),
    ),  # fmt: skip
    (
        ELEMENTWISE,
        (
            "elementwise_kernel",
            "reduce_kernel",
            "triton_poi_",
            "triton_red_",
            "triton_per_",
            "index_elementwise",
            "memset",
            "fill",
        ),
    ),  # fmt: skip
)


def kernel_bucket(name: str, op: str = "", phase: str = "") -> str:
    """The bucket of one kernel: ``name`` (a CUDA kernel's demangled name, or a CPU aten op), the
    aten op that launched it (``op``, may be empty) and the step phase it ran in (``phase``, one
    of ``PHASES`` or empty). Unknown names go to ``OTHER``."""
    text = f"{name} {op}".lower()
    if any(s in text for s in _ATTN_BWD) or ("sdpa" in text and "bprop" in text):
        return ATTN_BWD
    if any(s in text for s in _ATTN_FWD) or ("sdpa" in text and "fprop" in text):
        return ATTN_FWD
    if any(s in text for s in _GEMM):
        return GEMM
    if phase == "loss":
        return LOSS
    if phase == "optimizer":
        return OPTIM
    for bucket, needles in _BY_NAME:
        if any(s in text for s in needles):
            return bucket
    # A CPU profile's leaves are aten ops themselves: the rest of them is elementwise work.
    return ELEMENTWISE if name.startswith("aten::") else OTHER


@dataclass(frozen=True)
class KernelTime:
    """One kernel launch (or CPU op) of the profiled steps."""

    name: str
    us: float
    op: str = ""
    phase: str = ""
    start_us: float | None = None
    """Device start time (CUDA kernels), for ``idle_by_phase``; None where not known."""


@dataclass
class StepProfile:
    """Per-step time of one arm: milliseconds per bucket (``BUCKETS`` order, summing to
    ``wall_ms``), the largest uncategorised and overall kernels ``(name, bucket, ms, calls)``."""

    label: str
    n_steps: int
    wall_ms: float
    bucket_ms: dict[str, float]
    top_other: list[tuple[str, str, float, float]] = field(default_factory=list)
    top_kernels: list[tuple[str, str, float, float]] = field(default_factory=list)
    unprofiled_ms: float | None = None
    idle_ms_by_phase: dict[str, float] = field(default_factory=dict)

    @property
    def kernel_ms(self) -> float:
        return self.wall_ms - self.bucket_ms[IDLE]


GAP_TOLERANCE = 0.01
"""The share of a step by which the kernels may exceed its wall time (clock skew between the
host's timer and the device's timestamps) before the gap counts as negative."""


def check_gap(idle_ms: float, wall_ms: float, label: str) -> None:
    """Raise when the idle/host gap of a step is negative beyond ``GAP_TOLERANCE``: its kernels
    then took longer than the step, so something that is no kernel was counted, or kernels
    overlapped on several streams; the buckets would not add up to the step."""
    if idle_ms < -GAP_TOLERANCE * wall_ms:
        raise ValueError(
            f"{label}: the kernels sum to {wall_ms - idle_ms:.3f} ms per step, more than the "
            f"step's {wall_ms:.3f} ms (idle/host gap {idle_ms:.3f} ms < 0): a device event that "
            "is no kernel (a user-annotation range?) was counted, or kernels overlapped on "
            "several streams"
        )


UNMARKED = "unmarked (autograd's thread)"


def idle_by_phase(kernels: list[KernelTime], n_steps: int) -> dict[str, float]:
    """Milliseconds per step the device sat idle, by the phase of the kernel that ended the wait
    (``PHASES``, or ``UNMARKED`` for a kernel outside them: on CUDA the autograd engine launches
    the backward's kernels from its own thread, outside the ``backward`` range of the caller's
    thread): the gaps between one kernel's end (the latest end so far) and the next kernel's
    start, in start order. A gap before a ``forward`` kernel includes each step's start (its
    first launch after the previous step's sync). Kernels without a start time are left out;
    empty when none has one."""
    timed = sorted((k for k in kernels if k.start_us is not None), key=lambda k: k.start_us)
    out: dict[str, float] = {}
    if not timed:
        return out
    end_us = timed[0].start_us
    for k in timed:
        gap_us = k.start_us - end_us
        if gap_us > 0:
            phase = k.phase or UNMARKED
            out[phase] = out.get(phase, 0.0) + gap_us / 1e3 / n_steps
        end_us = max(end_us, k.start_us + k.us)
    return out


def summarise(
    kernels: list[KernelTime],
    wall_ms_total: float,
    n_steps: int,
    label: str,
    top_n: int = 12,
    unprofiled_ms: float | None = None,
) -> StepProfile:
    """Bucket ``kernels`` of ``n_steps`` steps that took ``wall_ms_total`` in all; per step."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if wall_ms_total <= 0:
        raise ValueError(f"wall_ms_total must be > 0, got {wall_ms_total}")
    bucket_ms = dict.fromkeys(BUCKETS, 0.0)
    by_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        bucket = kernel_bucket(k.name, k.op, k.phase)
        bucket_ms[bucket] += k.us / 1e3 / n_steps
        acc = by_name[(k.name, bucket)]
        acc[0] += k.us / 1e3 / n_steps
        acc[1] += 1 / n_steps
    wall_ms = wall_ms_total / n_steps
    bucket_ms[IDLE] = wall_ms - sum(bucket_ms.values())
    check_gap(bucket_ms[IDLE], wall_ms, label)
    ranked = sorted(((n, b, ms, c) for (n, b), (ms, c) in by_name.items()), key=lambda r: -r[2])
    return StepProfile(
        label=label,
        n_steps=n_steps,
        wall_ms=wall_ms,
        bucket_ms=bucket_ms,
        top_other=[r for r in ranked if r[1] == OTHER][:top_n],
        top_kernels=ranked[:top_n],
        unprofiled_ms=unprofiled_ms,
        idle_ms_by_phase=idle_by_phase(kernels, n_steps),
    )


def short_name(name: str, width: int = 110) -> str:
    """A kernel's name cut to ``width`` characters (demangled template names run to thousands)."""
    name = name.removeprefix("void ").replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."


def csv_rows(p: StepProfile) -> list[dict]:
    """One row per bucket: ``label, bucket, ms, pct`` (pct of the profiled step's wall time)."""
    return [
        {"label": p.label, "bucket": b, "ms": ms, "pct": 100 * ms / p.wall_ms}
        for b, ms in p.bucket_ms.items()
    ]


def to_csv(p: StepProfile) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["label", "bucket", "ms", "pct"])
    writer.writeheader()
    for row in csv_rows(p):
        writer.writerow({**row, "ms": f"{row['ms']:.4f}", "pct": f"{row['pct']:.2f}"})
    return buf.getvalue()


def _kernel_table(rows: list[tuple[str, str, float, float]], wall_ms: float) -> list[str]:
    lines = ["| kernel | bucket | ms / step | % | calls / step |", "|---|---|---|---|---|"]
    for name, bucket, ms, calls in rows:
        pct = 100 * ms / wall_ms
        lines.append(f"| `{short_name(name)}` | {bucket} | {ms:.3f} | {pct:.1f} | {calls:.0f} |")
    return lines


def to_markdown(p: StepProfile) -> str:
    """The bucket table, then the largest kernels and the largest uncategorised ones."""
    head = (
        f"### {p.label}: {p.wall_ms:.2f} ms per profiled step ({p.n_steps} steps), "
        f"kernels {p.kernel_ms:.2f} ms"
    )
    if p.unprofiled_ms is not None:
        head += f"; {p.unprofiled_ms:.2f} ms per step without the profiler"
    lines = [head, "", "| bucket | ms / step | % of step |", "|---|---|---|"]
    for b, ms in p.bucket_ms.items():
        lines.append(f"| {b} | {ms:.3f} | {100 * ms / p.wall_ms:.1f} |")
    if p.idle_ms_by_phase:
        parts = ", ".join(f"{ph} {ms:.3f}" for ph, ms in p.idle_ms_by_phase.items())
        lines += [
            "",
            f"Device idle between kernels, ms per step, by the phase it waited for: {parts}.",
        ]
    lines += ["", "Largest kernels:", "", *_kernel_table(p.top_kernels, p.wall_ms)]
    if p.top_other:
        lines += ["", "Largest uncategorised kernels:", "", *_kernel_table(p.top_other, p.wall_ms)]
    else:
        lines += ["", "Every kernel was categorised."]
    return "\n".join(lines) + "\n"


# ---- reading torch.profiler ---------------------------------------------------------------------


def _phase(event) -> str:
    """The innermost step phase (``PHASES``) around a profiler CPU event, or ''."""
    while event is not None:
        if event.name in PHASES:
            return event.name
        event = event.cpu_parent
    return ""


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Kineto activity types that are work on the device. The device timeline also holds
``gpu_user_annotation`` ranges (each ``record_function`` phase and torch's own
``Optimizer.step#AdamW.step``, projected onto the GPU) and ``cuda_sync`` waits: spans that
contain kernels, not kernels; counted, they would count the kernels' time twice."""


def is_device_work(activity_type: str, is_user_annotation: bool) -> bool:
    """Whether a device event is a kernel, memcpy or memset (``DEVICE_WORK``). A torch whose
    events carry no activity type: anything but a user annotation."""
    if activity_type:
        return activity_type in DEVICE_WORK
    return not is_user_annotation


def _kineto_kind(ke) -> tuple[str, bool]:
    """``(activity type, is user annotation)`` of a raw kineto event, '' / False where this
    torch does not say."""
    kind = ke.activity_type() if hasattr(ke, "activity_type") else ""
    annotation = ke.is_user_annotation() if hasattr(ke, "is_user_annotation") else False
    return kind or "", bool(annotation)


def kernels_from_profiler(prof, device_type: str) -> list[KernelTime]:
    """The kernels of a finished ``torch.profiler.profile``: on CUDA every device kernel, memcpy
    and memset (``is_device_work``: not the user-annotation ranges) with the aten op that
    launched it and its phase; on CPU every aten op's self time (the rest, autograd's and the
    compiler's wrappers and Python, is left to the idle/host gap)."""
    from torch.autograd import DeviceType

    events = prof.events()
    if device_type == "cpu":
        return [
            KernelTime(e.name, e.self_cpu_time_total, e.name, _phase(e.cpu_parent))
            for e in events
            if e.device_type == DeviceType.CPU
            and e.name.startswith("aten::")
            and e.self_cpu_time_total > 0
        ]
    kineto = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if kineto is None:  # a torch without the raw events: names alone
        return [
            KernelTime(e.trace_name or e.name, e.time_range.elapsed_us())
            for e in events
            if e.device_type == DeviceType.CUDA
            and is_device_work(
                getattr(e, "activity_type", "") or "", bool(getattr(e, "is_user_annotation", False))
            )
        ]
    by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    out = []
    for ke in kineto.events():
        if ke.device_type() != DeviceType.CUDA or not is_device_work(*_kineto_kind(ke)):
            continue
        launcher = by_id.get(ke.linked_correlation_id())
        op = launcher.name if launcher is not None else ""
        us = (ke.end_ns() - ke.start_ns()) / 1e3
        out.append(KernelTime(ke.name(), us, op, _phase(launcher), ke.start_ns() / 1e3))
    return out
