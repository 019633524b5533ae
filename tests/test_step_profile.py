"""The step profile's kernel buckets (pure), its table, and a CPU smoke of profile_step.py."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stabilitylab.analysis.step_profile import (
    ACT,
    ATTN_BWD,
    ATTN_FWD,
    BUCKETS,
    COPY,
    DROPOUT,
    ELEMENTWISE,
    EMBED,
    GEMM,
    IDLE,
    LOSS,
    NORM,
    OPTIM,
    OTHER,
    UNMARKED,
    KernelTime,
    idle_by_phase,
    is_device_work,
    kernel_bucket,
    kernels_from_profiler,
    summarise,
    to_csv,
    to_markdown,
)

ROOT = Path(__file__).resolve().parents[1]

# Names as CUDA kernels appear in torch.profiler traces of torch 2.x on Hopper (demangled).
KERNELS = [
    ("_sigmoid_fwd_dense_kernel", "", "forward", ATTN_FWD),
    ("_sigmoid_fwd_kernel", "", "forward", ATTN_FWD),
    ("_sigmoid_bwd_dq_dense_kernel", "", "", ATTN_BWD),
    ("_sigmoid_bwd_dkdv_kernel", "", "", ATTN_BWD),
    ("_softmax_bwd_delta_kernel", "", "", ATTN_BWD),
    ("_max_abs_logit_kernel", "", "forward", ATTN_FWD),
    (
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_"
        "cga1x1x1_kernel0_0",
        "aten::_scaled_dot_product_cudnn_attention",
        "forward",
        ATTN_FWD,
    ),
    (
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5_64x128x64_4x1x1_"
        "cga1x1x1_kernel0_0",
        "aten::_scaled_dot_product_cudnn_attention_backward",
        "",
        ATTN_BWD,
    ),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
        "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >"
        ", false, false, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "aten::_flash_attention_forward",
        "forward",
        ATTN_FWD,
    ),
    (
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64>>",
        "",
        "",
        ATTN_BWD,
    ),  # fmt: skip
    (
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>",
        "aten::_flash_attention_backward",
        "",
        ATTN_BWD,
    ),  # fmt: skip
    (
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>)",
        "aten::_efficient_attention_forward",
        "forward",
        ATTN_FWD,
    ),  # fmt: skip
    (
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)",
        "aten::_efficient_attention_backward",
        "",
        ATTN_BWD,
    ),  # fmt: skip
    # A zero-fill launched inside the attention's backward belongs to it.
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "",
        ATTN_BWD,
    ),  # fmt: skip
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
        "segment_k_off_kernel__5x_cublas",
        "aten::addmm",
        "forward",
        GEMM,
    ),  # fmt: skip
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "aten::mm", "", GEMM),
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "",
        "",
        GEMM,
    ),  # fmt: skip
    (
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
        "__nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, float const*)",
        "aten::mm",
        "",
        GEMM,
    ),  # fmt: skip
    # The head's GEMM inside a chunked loss stays a GEMM.
    ("nvjet_tst_192x192_64x4_2x1_v_bz_TNN", "aten::mm", "loss", GEMM),
    (
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>"
        "(int, float, float const*, float const*, float const*, float*, float*, float*)",
        "aten::native_layer_norm",
        "forward",
        NORM,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<float, "
        "float>(float const*, float const*, float const*, float const*, float const*, float*, int)",
        "aten::native_layer_norm_backward",
        "",
        NORM,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float,"
        " 32u, 32u, 256u, false, true>(long, long, float const*, float const*, float const*, "
        "float const*, float*, float*)",
        "aten::native_layer_norm_backward",
        "",
        NORM,
    ),  # fmt: skip
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::"
        "TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#"
        "4}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)",
        "aten::gelu",
        "forward",
        ACT,
    ),  # fmt: skip
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluBackwardCUDAKernelImpl"
        "(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const>",
        "aten::gelu_backward",
        "",
        ACT,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<float, float, unsigned "
        "int, 1, 4, bool>(at::cuda::detail::TensorInfo<float, unsigned int>, ...)",
        "aten::native_dropout",
        "forward",
        DROPOUT,
    ),  # fmt: skip
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
        "masked_scale_kernel<bool, float, float>(at::Tensor&, at::Tensor const&, at::Tensor const&"
        ", float)::{lambda(float, bool)#1}, std::array<char*, 3ul> >(int, ...)",
        "aten::native_dropout_backward",
        "",
        DROPOUT,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2"
        ", 2, -2, true>(at::cuda::detail::TensorInfo<float, unsigned int>, ...)",
        "aten::index_select",
        "forward",
        EMBED,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::krn_partials_per_segment<long>(long*, long const*"
        ", long, long)",
        "aten::embedding_dense_backward",
        "",
        EMBED,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::compute_grad_weight<float, long>(long const*, "
        "float const*, ...)",
        "aten::embedding_dense_backward",
        "",
        EMBED,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::"
        "native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "aten::_log_softmax",
        "loss",
        LOSS,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, "
        "float, long>(float*, float*, float const*, long const*, float const*, bool, long, long, "
        "long, long)",
        "aten::nll_loss_forward",
        "loss",
        LOSS,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::nll_loss_backward_reduce_cuda_kernel_2d<float, "
        "long>(float*, float const*, long const*, float const*, float const*, bool, int, int, "
        "long, long)",
        "aten::nll_loss_backward",
        "",
        LOSS,
    ),  # fmt: skip
    # Whatever the chunked loss launches is the loss's.
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<"
        "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, ...>)",
        "aten::amax",
        "loss",
        LOSS,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
        "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::"
        "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double,"
        " double, double, double, bool, float const*, float const*>(...)",
        "aten::_fused_adamw_",
        "optimizer",
        OPTIM,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
        "namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float,"
        " (at::native::(anonymous namespace)::NormType)1, float, float>, float*, int>(...)",
        "aten::_foreach_norm",
        "",
        OPTIM,
    ),  # fmt: skip
    # found_inf's isfinite in the optimizer phase.
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)",
        "aten::add",
        "optimizer",
        OPTIM,
    ),  # fmt: skip
    (
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda"
        "()#12}::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, ...)",
        "aten::copy_",
        "forward",
        COPY,
    ),  # fmt: skip
    (
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<at::native::"
        "(anonymous namespace)::OpaqueType<2u>, unsigned int, 4, 128, 1>(...)",
        "aten::cat",
        "",
        COPY,
    ),  # fmt: skip
    ("Memcpy DtoD (Device -> Device)", "aten::copy_", "", COPY),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::"
        "BFloat16>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, ...)",
        "aten::add",
        "forward",
        ELEMENTWISE,
    ),  # fmt: skip
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper"
        "_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::"
        "{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(...)",
        "aten::sum",
        "",
        ELEMENTWISE,
    ),  # fmt: skip
    ("triton_red_fused__to_copy_add_native_dropout_native_layer_norm_3", "", "forward", NORM),
    ("triton_poi_fused_gelu_gelu_backward_7", "", "", ACT),
    ("triton_poi_fused__to_copy_0", "", "", COPY),
    ("triton_poi_fused_add_mul_12", "", "", ELEMENTWISE),
    ("triton_tem_fused_mm_5", "", "", GEMM),
    ("aten::native_layer_norm", "aten::native_layer_norm", "forward", NORM),  # a CPU profile
    ("aten::mm", "aten::mm", "", GEMM),
    ("aten::mul", "aten::mul", "", ELEMENTWISE),
    ("some_new_kernel_nobody_named<int>", "", "", OTHER),
]


@pytest.mark.parametrize("name, op, phase, bucket", KERNELS, ids=lambda v: str(v)[:40])
def test_kernel_bucket(name, op, phase, bucket):
    assert kernel_bucket(name, op, phase) == bucket


def _kernels():
    return [
        KernelTime("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 3000.0, "aten::mm"),
        KernelTime("_sigmoid_fwd_dense_kernel", 1500.0, "", "forward"),
        KernelTime("weird_kernel_a", 400.0),
        KernelTime("weird_kernel_b", 100.0),
        KernelTime("weird_kernel_a", 400.0),
    ]


def test_buckets_sum_to_the_wall_time_and_the_gap_is_the_rest():
    p = summarise(_kernels(), wall_ms_total=12.0, n_steps=2, label="arm / eager")
    assert list(p.bucket_ms) == list(BUCKETS)
    assert sum(p.bucket_ms.values()) == pytest.approx(p.wall_ms) == pytest.approx(6.0)
    assert p.bucket_ms[GEMM] == pytest.approx(1.5)
    assert p.bucket_ms[ATTN_FWD] == pytest.approx(0.75)
    assert p.bucket_ms[OTHER] == pytest.approx(0.45)
    assert p.bucket_ms[IDLE] == pytest.approx(6.0 - 2.7)
    assert p.kernel_ms == pytest.approx(2.7)
    # The uncategorised kernels, largest first, with calls per step.
    assert [(n, ms, c) for n, _, ms, c in p.top_other] == [
        ("weird_kernel_a", pytest.approx(0.4), pytest.approx(1.0)),
        ("weird_kernel_b", pytest.approx(0.05), pytest.approx(0.5)),
    ]
    assert p.top_kernels[0][0].startswith("nvjet")


def test_tables_name_every_bucket_and_the_unknown_kernels():
    p = summarise(_kernels(), 12.0, 2, "softmax / eager", unprofiled_ms=5.5)
    md = to_markdown(p)
    for b in BUCKETS:
        assert f"| {b} |" in md
    assert "weird_kernel_a" in md and "5.50 ms per step without the profiler" in md
    rows = list(csv.DictReader(to_csv(p).splitlines()))
    assert [r["bucket"] for r in rows] == list(BUCKETS)
    assert sum(float(r["pct"]) for r in rows) == pytest.approx(100, abs=0.1)


def test_summarise_rejects_bad_counts():
    with pytest.raises(ValueError, match="n_steps"):
        summarise([], 1.0, 0, "x")
    with pytest.raises(ValueError, match="wall_ms_total"):
        summarise([], 0.0, 1, "x")


def test_a_negative_idle_gap_is_refused_naming_the_arm():
    """Kernels summing to more than the step (a range that is no kernel, counted) raise; a gap
    within the clock tolerance does not."""
    with pytest.raises(ValueError, match="softmax / eager.*idle/host gap"):
        summarise([KernelTime("k", 7000.0)], wall_ms_total=6.0, n_steps=1, label="softmax / eager")
    p = summarise([KernelTime("k", 6020.0)], wall_ms_total=6.0, n_steps=1, label="x")
    assert p.bucket_ms[IDLE] == pytest.approx(-0.02)


class _CpuEvent:
    """What ``prof.events()`` yields: a FunctionEvent's fields that the reader uses."""

    def __init__(self, id, name, parent=None, device_type=None):
        from torch.autograd import DeviceType

        self.id, self.name, self.cpu_parent = id, name, parent
        self.device_type = DeviceType.CPU if device_type is None else device_type


class _KinetoEvent:
    """A raw kineto event (``prof.profiler.kineto_results.events()``)."""

    def __init__(self, name, start_us, end_us, kind, annotation=False, link=0, cuda=True):
        from torch.autograd import DeviceType

        self._name, self._kind, self._annotation, self._link = name, kind, annotation, link
        self._span = (int(start_us * 1e3), int(end_us * 1e3))
        self._device = DeviceType.CUDA if cuda else DeviceType.CPU

    def name(self):
        return self._name

    def device_type(self):
        return self._device

    def activity_type(self):
        return self._kind

    def is_user_annotation(self):
        return self._annotation

    def linked_correlation_id(self):
        return self._link

    def start_ns(self):
        return self._span[0]

    def end_ns(self):
        return self._span[1]


class _FakeProfile:
    def __init__(self, cpu_events, kineto_events):
        self._cpu = cpu_events
        self.profiler = type("P", (), {})()
        self.profiler.kineto_results = type("K", (), {"events": lambda _: kineto_events})()

    def events(self):
        return self._cpu


def test_kernels_from_profiler_leaves_out_the_annotation_ranges():
    """The device timeline of one step as torch 2.x's kineto gives it: the record_function
    phases and torch's optimizer range appear as ``gpu_user_annotation`` spans over the kernels
    they contain; only kernels, memcpys and memsets are read, each with its launching op and
    phase, and the buckets then add up to the step."""
    forward = _CpuEvent(1, "forward")
    mm = _CpuEvent(2, "aten::mm", forward)
    optimizer = _CpuEvent(3, "optimizer")
    adam = _CpuEvent(4, "aten::_fused_adamw_", _CpuEvent(5, "Optimizer.step#AdamW.step", optimizer))
    kineto = [
        _KinetoEvent("forward", 0, 900, "user_annotation", True, cuda=False),
        _KinetoEvent("forward", 10, 900, "gpu_user_annotation", True),
        _KinetoEvent("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 10, 800, "kernel", link=2),
        _KinetoEvent("Memcpy DtoD (Device -> Device)", 800, 850, "gpu_memcpy"),
        _KinetoEvent("Memset (Device)", 850, 860, "gpu_memset"),
        _KinetoEvent("optimizer", 900, 1000, "gpu_user_annotation", True),
        _KinetoEvent("Optimizer.step#AdamW.step", 905, 1000, "gpu_user_annotation", True),
        _KinetoEvent("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 910, 990, "kernel", link=4),
        _KinetoEvent("Stream Sync", 990, 1000, "cuda_sync"),
    ]
    prof = _FakeProfile([forward, mm, optimizer, adam], kineto)
    got = kernels_from_profiler(prof, "cuda")
    assert [(k.name[:6], k.op, k.phase) for k in got] == [
        ("nvjet_", "aten::mm", "forward"),
        ("Memcpy", "", ""),
        ("Memset", "", ""),
        ("multi_", "aten::_fused_adamw_", "optimizer"),
    ]
    assert [k.us for k in got] == pytest.approx([790, 50, 10, 80])
    p = summarise(got, wall_ms_total=1.0, n_steps=1, label="fake")
    assert p.bucket_ms[OTHER] == 0 and p.bucket_ms[OPTIM] == pytest.approx(0.08)
    assert p.bucket_ms[IDLE] == pytest.approx(0.07)
    assert p.idle_ms_by_phase == pytest.approx({"optimizer": 0.05})  # 860 -> 910 us


def test_idle_by_phase_counts_the_waits_between_kernels_once():
    """Gaps go to the phase of the kernel that ends them, per step; a kernel that overlaps
    another (another stream) opens no gap, and one inside a longer one does not end its span."""
    ks = [
        KernelTime("a", 100.0, phase="forward", start_us=0.0),
        KernelTime("inside", 10.0, phase="forward", start_us=20.0),
        KernelTime("b", 50.0, phase="loss", start_us=300.0),  # 200 us after a ends
        KernelTime("c", 50.0, phase="backward", start_us=340.0),  # overlaps b: no gap
        KernelTime("d", 10.0, start_us=490.0),  # 100 us after c
        KernelTime("untimed", 1e6),
    ]
    assert idle_by_phase(ks, n_steps=2) == pytest.approx({"loss": 0.1, UNMARKED: 0.05})
    assert idle_by_phase([KernelTime("k", 5.0)], 1) == {}
    table = to_markdown(summarise(ks[:5], wall_ms_total=1.0, n_steps=1, label="x"))
    assert f"by the phase it waited for: loss 0.200, {UNMARKED} 0.100." in table


def test_is_device_work_without_an_activity_type_drops_annotations():
    assert is_device_work("kernel", False) and is_device_work("gpu_memset", False)
    assert not is_device_work("gpu_user_annotation", True)
    assert not is_device_work("cuda_sync", False)
    assert is_device_work("", False) and not is_device_work("", True)


def test_profile_step_cpu_smoke(tmp_path):
    """The script end to end on CPU: tiny model, one arm, eager and the chunked loss; the CSV's
    buckets add up to the profiled step, and the matmuls were seen."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, str(ROOT / "experiments/bench/profile_step.py"), "--device", "cpu",
        "--tiny", "--arms", "softmax", "--variants", "eager", "chunked-ce", "--warmup", "1",
        "--steps", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    for variant in ("eager", "chunked-ce"):
        rows = list(csv.DictReader((tmp_path / f"softmax__{variant}.csv").open()))
        ms = {r["bucket"]: float(r["ms"]) for r in rows}
        md = (tmp_path / f"softmax__{variant}.md").read_text()
        wall = float(md.split(": ", 1)[1].split(" ms per profiled step")[0])
        assert sum(ms.values()) == pytest.approx(wall, abs=0.01)
        assert ms[GEMM] > 0 and ms[LOSS] > 0 and ms[NORM] > 0
    assert "softmax / chunked-ce" in (tmp_path / "profile.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arm", ["sigmoid-triton", "softmax"])
def test_profile_buckets_a_real_cuda_step(arm):
    """On the GPU: the kernels of a real step land in their buckets, few of them uncategorised."""
    from stabilitylab.config import ModelConfig
    from stabilitylab.presets import smoke
    from stabilitylab.train.levers import build_rig

    sys.path.insert(0, str(ROOT / "experiments/bench"))
    from profile_step import profile_rig

    cfg = smoke()
    cfg.model = ModelConfig(n_layers=2, d_model=128, n_heads=2, d_ff=512, dropout=0.1)
    cfg.data.context_len = 1024
    p = profile_rig(build_rig(cfg, arm, "eager", "cuda"), warmup=2, steps=2, trace=None)
    for bucket in (ATTN_FWD, ATTN_BWD, GEMM, NORM, ACT, DROPOUT, EMBED, LOSS, OPTIM):
        assert p.bucket_ms[bucket] > 0, (bucket, to_markdown(p))
    assert p.bucket_ms[OTHER] <= 0.1 * p.kernel_ms, to_markdown(p)
