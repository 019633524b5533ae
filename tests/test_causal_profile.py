"""analysis/causal_profile.py: kernel roles, a call's breakdown and the profiler reader, on
synthetic profiler tables (no GPU, no profiler run; bench_causal's smoke test runs the profiler)."""

import math
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from stabilitylab.analysis import causal_profile as cp
from stabilitylab.analysis.causal_profile import DeviceEvent, Window

# Ancestors as the reader gives them on CUDA: the launching aten op first, then its ranges.
FWD_LOG = ("aten::log", cp.LOG_G_RANGE, cp.OP_RANGE, cp.WINDOW)
FWD_GV = ("aten::mul", cp.GV_RANGE, cp.OP_RANGE, cp.WINDOW)
FWD_OP = ("aten::zeros", cp.OP_RANGE, cp.WINDOW)
BWD_HEAD_SUM = (
    "aten::sum",
    "ExpandBackward0",
    "autograd::engine::evaluate_function: ExpandBackward0",
)
BWD_GV = ("aten::sum", "autograd::engine::evaluate_function: MulBackward0")
BWD_LOG = ("aten::div", "LogBackward0", "autograd::engine::evaluate_function: LogBackward0")
BWD_OP = ("aten::sum", "_EagerSigmoidAttentionBackward",
          "autograd::engine::evaluate_function: _EagerSigmoidAttentionBackward")  # fmt: skip
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<>>"
REDUCE = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func>>"


@pytest.mark.parametrize(
    "name, ancestors, role",
    [
        ("_sigmoid_fwd_kernel", FWD_LOG, cp.ATTN),  # by name, wherever it was launched
        ("_sigmoid_bwd_dkdv_kernel", BWD_OP, cp.ATTN),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5", (), cp.ATTN),
        (ELEMENTWISE, FWD_LOG, cp.LOG_G),
        (ELEMENTWISE, FWD_GV, cp.GV),
        (ELEMENTWISE, ("aten::_to_copy", "aten::to", cp.GV_RANGE, cp.OP_RANGE), cp.GV),
        (ELEMENTWISE, FWD_OP, cp.OP_OTHER),
        (REDUCE, BWD_HEAD_SUM, cp.DBIAS),
        (REDUCE, BWD_GV, cp.GV),
        (ELEMENTWISE, BWD_LOG, cp.LOG_G),
        (REDUCE, BWD_OP, cp.OP_OTHER),
        (ELEMENTWISE, ("aten::add", "autograd::engine::evaluate_function: AddBackward0"), cp.LOG_G),
        (ELEMENTWISE, ("aten::fill_",), cp.OTHER),
        (ELEMENTWISE, (), cp.OTHER),
    ],
)
def test_roles_by_kernel_name_then_the_nearest_listed_ancestor(name, ancestors, role):
    assert cp.event_role(name, ancestors) == role


def test_the_nearest_ancestor_wins():
    inner_gate = ("aten::mul", cp.GV_RANGE, cp.LOG_G_RANGE, cp.OP_RANGE)
    assert cp.event_role(ELEMENTWISE, inner_gate) == cp.GV
    assert cp.event_role(ELEMENTWISE, inner_gate[:1] + inner_gate[2:]) == cp.LOG_G


def _call():
    """One call in [0, 100] us: attention 10-40, log g 45-50, head sum 52-55, other 60-70."""
    events = [
        DeviceEvent("_sigmoid_fwd_kernel", 10, 40, FWD_OP),
        DeviceEvent(ELEMENTWISE, 45, 50, FWD_LOG),
        DeviceEvent(REDUCE, 52, 55, BWD_HEAD_SUM),
        DeviceEvent(ELEMENTWISE, 60, 70, ()),
    ]
    return events, Window(0, 100)


def test_a_call_splits_into_roles_host_gaps_and_tail_that_add_up_to_its_wall():
    events, window = _call()
    parts = cp.call_parts(events, window)
    assert parts[cp.ATTN] == 30 and parts[cp.LOG_G] == 5 and parts[cp.DBIAS] == 3
    assert parts[cp.OTHER] == 10 and parts[cp.GV] == 0 and parts[cp.OP_OTHER] == 0
    assert parts[cp.HEAD] == 10 and parts[cp.TAIL] == 30
    assert parts[cp.GAPS] == 5 + 2 + 5
    assert sum(parts[r] for r in cp.ROLES) == 100 and parts["overlap"] == 0
    # Order does not matter; an event reaching past the window is clipped to it.
    late = [*reversed(events), DeviceEvent(ELEMENTWISE, 90, 130, ())]
    parts = cp.call_parts(late, window)
    assert parts[cp.OTHER] == 20 and parts[cp.TAIL] == 0 and parts[cp.GAPS] == 12 + 20


def test_overlapping_kernels_count_once_in_the_gaps_and_show_as_overlap():
    events = [DeviceEvent("_sigmoid_fwd_kernel", 10, 30), DeviceEvent(ELEMENTWISE, 20, 40)]
    parts = cp.call_parts(events, Window(0, 50))
    assert parts[cp.ATTN] == 20 and parts[cp.OTHER] == 20
    assert parts[cp.GAPS] == 0 and parts["overlap"] == 10
    assert parts[cp.HEAD] == 10 and parts[cp.TAIL] == 10


def test_a_call_without_kernels_is_all_host():
    parts = cp.call_parts([], Window(5, 25))
    assert parts[cp.HEAD] == 20 and sum(parts[r] for r in cp.ROLES) == 20


def test_events_go_to_the_window_they_start_in_and_outside_ones_are_dropped():
    w1, w2 = Window(0, 10), Window(20, 30)
    evs = [DeviceEvent("a", 1, 2), DeviceEvent("b", 9, 12), DeviceEvent("c", 15, 16),
           DeviceEvent("d", 20, 21), DeviceEvent("e", 35, 36)]  # fmt: skip
    by_window = cp.split_by_window(evs, [w2, w1])  # in the windows' order given
    assert [e.name for e in by_window[0]] == ["d"]
    assert [e.name for e in by_window[1]] == ["a", "b"]
    with pytest.raises(ValueError, match="windows overlap"):
        cp.split_by_window(evs, [Window(0, 10), Window(5, 15)])


def test_mean_parts_averages_the_calls_and_is_nan_without_one():
    events, w = _call()
    shifted = [DeviceEvent(e.name, e.start_us + 200, e.end_us + 200, e.ancestors) for e in events]
    second = Window(200, 320)  # the same kernels, 20 us more tail
    mean = cp.mean_parts(events + shifted, [w, second])
    assert mean["calls"] == 2 and mean["wall"] == 110
    assert mean[cp.ATTN] == 30 and mean[cp.TAIL] == 40
    assert math.isclose(sum(mean[r] for r in cp.ROLES), mean["wall"])
    empty = cp.mean_parts([], [])
    assert empty["calls"] == 0 and math.isnan(empty["wall"]) and math.isnan(empty[cp.ATTN])


def test_kernel_table_means_per_call_largest_first():
    events, w = _call()
    rows = cp.kernel_table(events + [DeviceEvent(ELEMENTWISE, 80, 82, ())], [w, Window(500, 600)])
    assert rows[0] == {"kernel": "_sigmoid_fwd_kernel", "role": cp.ATTN, "us": 15, "per_call": 0.5}
    other = next(r for r in rows if r["kernel"] == ELEMENTWISE and r["role"] == cp.OTHER)
    assert other["us"] == 6 and other["per_call"] == 1  # 10 + 2 us, two launches, two calls


def test_tables_show_one_phase_nan_as_dash_and_no_attention_in_the_kernel_list():
    nan = float("nan")
    base = {**dict.fromkeys((*cp.ROLES, "wall"), 1.0), "wall_unprof": 2.0, "host_unprof": nan}
    rows = [{"T": 512, "provider": "sigmoid", "phase": "fwd", **base},
            {"T": 512, "provider": "sigmoid", "phase": "bwd", **base, "wall": 7.0}]  # fmt: skip
    text = cp.breakdown_markdown(rows, "bwd")
    assert text.count("\n") == 2 and "| 512 | sigmoid | 2.0 | - | 7.0 |" in text
    kernels = [{"T": 512, "provider": "p", "phase": "fwd", "kernel": k, "role": r, "us": 1.0,
                "per_call": 1.0} for k, r in [("attn", cp.ATTN), ("a", cp.OTHER),
                                              ("b", cp.GV), ("c", cp.OTHER)]]  # fmt: skip
    listed = cp.kernels_markdown(kernels, top_n=2)
    assert "`a`" in listed and "`b`" in listed and "`c`" not in listed and "attn" not in listed


# ---- the reader, on a fake profile ------------------------------------------------------------


def _fn_event(id_, name, parent=None):
    return SimpleNamespace(id=id_, name=name, device_type=DeviceType.CPU, cpu_parent=parent,
                           cpu_children=[], time_range=SimpleNamespace(start=0, end=0))  # fmt: skip


def _kineto(name, device, start_ns, end_ns, linked=0, kind="kernel", annotation=False):
    return SimpleNamespace(
        name=lambda: name, device_type=lambda: device, start_ns=lambda: start_ns,
        end_ns=lambda: end_ns, linked_correlation_id=lambda: linked,
        activity_type=lambda: kind, is_user_annotation=lambda: annotation,
    )  # fmt: skip


def test_the_cuda_reader_links_kernels_to_their_ops_ranges_and_reads_the_windows():
    window = _fn_event(1, cp.WINDOW)
    gate = _fn_event(2, cp.LOG_G_RANGE, window)
    log = _fn_event(3, "aten::log", gate)
    raw = [
        _kineto(cp.WINDOW, DeviceType.CPU, 1_000, 9_000, kind="user_annotation", annotation=True),
        # The window projected onto the GPU: a range, not a kernel.
        _kineto(cp.WINDOW, DeviceType.CUDA, 1_500, 8_000, kind="gpu_user_annotation"),
        _kineto(ELEMENTWISE, DeviceType.CUDA, 2_000, 2_500, linked=3),
        _kineto("Memset (Device)", DeviceType.CUDA, 3_000, 3_100, kind="gpu_memset"),
        _kineto("cudaDeviceSynchronize", DeviceType.CUDA, 3_200, 8_500, kind="cuda_sync"),
    ]
    prof = SimpleNamespace(
        events=lambda: [window, gate, log],
        profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: raw)),
    )
    events, windows = cp.read_profile(prof, cuda=True)
    assert windows == [Window(1.0, 9.0)]
    assert events == [
        DeviceEvent(ELEMENTWISE, 2.0, 2.5, ("aten::log", cp.LOG_G_RANGE, cp.WINDOW)),
        DeviceEvent("Memset (Device)", 3.0, 3.1, ()),  # no launching op found: no ancestors
    ]
    parts = cp.mean_parts(events, windows)
    assert parts[cp.LOG_G] == pytest.approx(0.5) and parts[cp.OTHER] == pytest.approx(0.1)
