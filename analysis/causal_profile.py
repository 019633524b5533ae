"""Where one causal attention call's time goes: profiler events -> roles -> a table (pure maths).

``experiments/bench/bench_causal.py --profile`` runs an op variant's forward, then its backward,
``n`` times under ``torch.profiler``, each call inside a ``record_function(WINDOW)`` range that
ends with a device sync. This module reads the device kernels (each with the names of the CPU
ranges above the op that launched it, nearest first: its *ancestors*) and the windows, then
splits each call's wall time (the window) exactly:

    wall = sum over ROLES of kernel time + HEAD + GAPS + TAIL
    HEAD: window start -> first kernel start (Python, the op's host work, the first launch)
    GAPS: device idle between the call's first kernel start and last kernel end (launch-bound)
    TAIL: last kernel end -> window end (the sync returning to the host)

A kernel's role (``event_role``), first match wins: an attention kernel by its name
(``step_profile``'s patterns: ours, cuDNN, flash, Flex) is ``ATTN``; else the nearest ancestor
listed in ``ROLE_BY_ANCESTOR``: the bench's ranges around the gate's halves and the autograd nodes
of their gradients (``LOG_G``: log(g + eps); ``GV``: g * v and its cast), the gradient of a
``key_bias_BT`` expanded over the heads (``DBIAS``: its sum over H), the op's own other kernels
(``OP_OTHER``: the bench's range around the op, the op's backward node); else ``OTHER``. On CUDA
the autograd engine launches the backward from its own thread, outside the caller's ranges: its
kernels are told apart by their autograd nodes, and assigned to calls by time. On CPU (the smoke
run) the "kernels" are the leaf aten ops; Triton's interpreter runs kernels as Python, which then
shows as HEAD / GAPS.

Times are microseconds on the profiler's clock; a table gives the mean per call, so its parts add
up to the mean wall time of a call under the profiler (which inflates host time: the bench adds
the unprofiled wall and host times of the same calls).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stabilitylab.analysis.step_profile import (
    ATTN_BWD,
    ATTN_FWD,
    is_device_work,
    kernel_bucket,
    short_name,
)

WINDOW = "causal.call"
"""The ``record_function`` name around each profiled call."""
OP_RANGE = "causal.op"
"""The bench's range around a whole provider call (gate ranges nest inside it)."""
LOG_G_RANGE, GV_RANGE = "gate: log g", "gate: g*v"

ATTN, LOG_G, GV, DBIAS = "attention kernels", "gate log g", "gate g*v", "d-bias head sum"
OP_OTHER, OTHER = "op, other kernels", "other kernels"
HEAD, GAPS, TAIL = "host before 1st kernel", "device idle between", "sync tail"
KERNEL_ROLES = (ATTN, LOG_G, GV, DBIAS, OP_OTHER, OTHER)
ROLES = (*KERNEL_ROLES, HEAD, GAPS, TAIL)

ROLE_BY_ANCESTOR = (
    (LOG_G, (LOG_G_RANGE, "LogBackward0", "AddBackward0")),
    (GV, (GV_RANGE, "MulBackward0", "ToCopyBackward0")),
    (DBIAS, ("ExpandBackward0",)),
    (OP_OTHER, (OP_RANGE, "SigmoidAttentionBackward", "sigmoid_attention_bwd")),
)
"""(role, substrings of an ancestor's name). ``AddBackward0``: the gradient of g + eps, and the
engine's sum of the gate's two gradients (it runs in that node's range); ``ToCopyBackward0``: the
gate's cast to v's dtype before g * v."""


@dataclass(frozen=True)
class DeviceEvent:
    """One kernel (CUDA) or leaf op (CPU): name, start and end (us, the profiler's clock), the
    names of the ranges above its launching op, nearest first (the op itself first)."""

    name: str
    start_us: float
    end_us: float
    ancestors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Window:
    """One profiled call: its ``record_function`` range (us, the same clock as the events)."""

    start_us: float
    end_us: float


def event_role(name: str, ancestors: Sequence[str] = ()) -> str:
    """The role of one kernel (module docstring): attention by name, else its nearest ancestor in
    ``ROLE_BY_ANCESTOR``, else ``OTHER``."""
    if kernel_bucket(name) in (ATTN_FWD, ATTN_BWD):
        return ATTN
    for ancestor in ancestors:
        for role, needles in ROLE_BY_ANCESTOR:
            if any(s in ancestor for s in needles):
                return role
    return OTHER


def split_by_window(
    events: Sequence[DeviceEvent], windows: Sequence[Window]
) -> list[list[DeviceEvent]]:
    """The events of each window, by start time (a window holds an event that starts inside it;
    an event outside every window, such as a warm-up's, is left out). Windows must not overlap."""
    ordered = sorted(windows, key=lambda w: w.start_us)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.start_us < a.end_us:
            raise ValueError(f"windows overlap: {a} and {b}")
    out: list[list[DeviceEvent]] = [[] for _ in windows]
    index = {id(w): i for i, w in enumerate(windows)}
    starts = [w.start_us for w in ordered]
    for e in events:
        i = bisect.bisect_right(starts, e.start_us) - 1
        if i >= 0 and e.start_us < ordered[i].end_us:
            out[index[id(ordered[i])]].append(e)
    return out


def call_parts(events: Sequence[DeviceEvent], window: Window) -> dict[str, float]:
    """One call's wall time split over ``ROLES`` (us), summing to the window's length. Events are
    clipped to the window; the busy time is their union, so kernels that overlap (several streams)
    count once in the gaps but each in its role: ``overlap`` (returned too, 0 on one stream) is
    by how much the kernel roles then exceed the union."""
    parts = dict.fromkeys(ROLES, 0.0)
    wall = window.end_us - window.start_us
    spans = sorted(
        ((max(e.start_us, window.start_us), min(e.end_us, window.end_us), e) for e in events),
        key=lambda span: span[:2],
    )
    spans = [(s, t, e) for s, t, e in spans if t > s]
    if not spans:
        parts[HEAD] = wall
        return {**parts, "overlap": 0.0}
    busy, cur_s, cur_t = 0.0, spans[0][0], spans[0][1]
    for s, t, e in spans:
        parts[event_role(e.name, e.ancestors)] += t - s
        if s > cur_t:
            busy += cur_t - cur_s
            cur_s, cur_t = s, t
        else:
            cur_t = max(cur_t, t)
    busy += cur_t - cur_s
    first, last = spans[0][0], max(t for _, t, _ in spans)
    parts[HEAD] = first - window.start_us
    parts[TAIL] = window.end_us - last
    parts[GAPS] = (last - first) - busy
    overlap = sum(parts[r] for r in KERNEL_ROLES) - busy
    return {**parts, "overlap": overlap}


def mean_parts(events: Sequence[DeviceEvent], windows: Sequence[Window]) -> dict[str, float]:
    """Mean over the calls (windows) of ``call_parts``, plus ``wall`` (the mean window) and
    ``calls``; NaN parts for no window (NaN is data)."""
    if not windows:
        return {**dict.fromkeys((*ROLES, "overlap", "wall"), float("nan")), "calls": 0}
    per_call = [call_parts(ev, w) for ev, w in zip(split_by_window(events, windows), windows,
                                                    strict=True)]  # fmt: skip
    keys = (*ROLES, "overlap")
    out = {k: sum(p[k] for p in per_call) / len(per_call) for k in keys}
    out["wall"] = sum(w.end_us - w.start_us for w in windows) / len(windows)
    out["calls"] = len(windows)
    return out


def kernel_table(events: Sequence[DeviceEvent], windows: Sequence[Window]) -> list[dict]:
    """Every kernel name in the windows with its role, mean us and launches per call, largest
    first: so that nothing in ``OTHER`` / ``OP_OTHER`` hides."""
    n = max(1, len(windows))
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for evs in split_by_window(events, windows):
        for e in evs:
            a = acc[(e.name, event_role(e.name, e.ancestors))]
            a[0] += (e.end_us - e.start_us) / n
            a[1] += 1 / n
    rows = [{"kernel": k, "role": r, "us": us, "per_call": c} for (k, r), (us, c) in acc.items()]
    return sorted(rows, key=lambda r: -r["us"])


# ---- tables ---------------------------------------------------------------------------------

COLUMNS = ("wall", *ROLES)


def breakdown_markdown(rows: Sequence[dict], phase: str) -> str:
    """One table for ``phase`` (fwd / bwd): a row per (T, provider) of the rows given (each a
    ``mean_parts`` dict with ``T``, ``provider``, ``phase``, and the unprofiled ``wall_unprof``
    and ``host_unprof``), us per call."""
    fmt = lambda x: "-" if x != x else f"{x:.1f}"  # NaN -> "-"
    head = ["T", "provider", "unprofiled wall", "unprofiled host", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["phase"] != phase:
            continue
        cells = [str(r["T"]), r["provider"], fmt(r["wall_unprof"]), fmt(r["host_unprof"])]
        cells += [fmt(r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernels_markdown(rows: Sequence[dict], top_n: int = 8) -> str:
    """Per (T, provider, phase) the ``top_n`` largest kernels outside ``ATTN`` (rows as
    ``kernel_table`` gives them, largest first, with ``T``, ``provider``, ``phase``)."""
    lines = ["| T | provider | phase | kernel | role | us / call | launches / call |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    shown: dict[tuple, int] = defaultdict(int)
    for r in rows:
        key = (r["T"], r["provider"], r["phase"])
        if r["role"] == ATTN or shown[key] >= top_n:
            continue
        shown[key] += 1
        lines.append(f"| {r['T']} | {r['provider']} | {r['phase']} | "
                     f"`{short_name(r['kernel'], 80)}` | {r['role']} | {r['us']:.1f} "
                     f"| {r['per_call']:.0f} |")  # fmt: skip
    return "\n".join(lines)


# ---- running and reading torch.profiler -------------------------------------------------------


def time_calls(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> tuple[float, float]:
    """``(wall, host)`` medians in us over ``n`` calls of ``fn``, each between two syncs, without
    the profiler: wall to the sync's return, host to ``fn``'s return (the launches)."""
    walls, hosts = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        hosts.append((t1 - t0) * 1e6)
        walls.append((t2 - t0) * 1e6)
    return statistics.median(walls), statistics.median(hosts)


def profile_calls(
    fn: Callable[[], object], n: int, sync: Callable[[], None], cuda: bool
) -> tuple[list[DeviceEvent], list[Window]]:
    """Run ``fn`` ``n`` times under ``torch.profiler``, each call and a ``sync`` inside a
    ``WINDOW`` range; the events (``read_profile``) and windows. One call outside any window
    first: the profiler's first kernels carry its own start-up (left out by ``split_by_window``)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        fn()
        sync()
        for _ in range(n):
            with record_function(WINDOW):
                fn()
                sync()
    return read_profile(prof, cuda)


def _ancestors(event) -> tuple[str, ...]:
    """The names of ``event`` (a profiler FunctionEvent) and the CPU ranges above it."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return tuple(names)


def read_profile(prof, cuda: bool) -> tuple[list[DeviceEvent], list[Window]]:
    """The events and windows of a finished profile. CUDA: every device kernel, memcpy and memset
    (``is_device_work``) from the raw kineto events, with its launching op's ancestors (the op
    is the CPU event whose id is the kernel's linked correlation id), and the ``WINDOW`` ranges
    of the CPU timeline, both in kineto's ns. CPU: the leaf aten ops (no children) and windows of
    ``prof.events()``."""
    from torch.autograd import DeviceType

    events = prof.events()
    if not cuda:
        windows = [Window(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CPU and e.name == WINDOW]  # fmt: skip
        leaves = [DeviceEvent(e.name, e.time_range.start, e.time_range.end, _ancestors(e))
                  for e in events if e.device_type == DeviceType.CPU
                  and e.name.startswith("aten::") and not e.cpu_children]  # fmt: skip
        return leaves, windows
    by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    out, windows = [], []
    for ke in prof.profiler.kineto_results.events():
        start, end = ke.start_ns() / 1e3, ke.end_ns() / 1e3
        if ke.device_type() == DeviceType.CPU:
            if ke.name() == WINDOW:
                windows.append(Window(start, end))
            continue
        kind = ke.activity_type() if hasattr(ke, "activity_type") else ""
        annotation = ke.is_user_annotation() if hasattr(ke, "is_user_annotation") else False
        if ke.device_type() != DeviceType.CUDA or not is_device_work(kind or "", bool(annotation)):
            continue
        launcher = by_id.get(ke.linked_correlation_id())
        out.append(DeviceEvent(ke.name(), start, end, _ancestors(launcher)))
    return out, windows
