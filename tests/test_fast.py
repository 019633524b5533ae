"""The fast step (train.fast) on CPU: the eager step's loss curve, every telemetry tag, divergence
still recorded; graph breaks fall back; jagged lengths share one graph; the presets' defaults,
the refused combinations and resumes across the flag. torch.compile runs with the aot_eager
backend here (dynamo and AOT autograd trace as for inductor, no C++ is generated: CI has 2
cores and no promise of a C compiler)."""

import json
import math
from contextlib import nullcontext

import pytest
import torch

from stabilitylab import attention
from stabilitylab import config as C
from stabilitylab.analysis.curves import curve_gap
from stabilitylab.analysis.events import load_runs
from stabilitylab.attention import register, sigmoid_reference
from stabilitylab.data.batch import Batch
from stabilitylab.model import Transformer
from stabilitylab.presets import PRESETS
from stabilitylab.train import fast, run
from stabilitylab.train.checkpoint import read_state
from stabilitylab.train.resume import config_changes
from tests.tiny_runs import arm_dir, tiny


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    monkeypatch.setattr(fast, "COMPILE_BACKEND", "aot_eager")


def _train(out, step_kind: str, *overrides):
    cfg = tiny(
        out, "--arm=sigmoid", "--train.steps=6", f"--train.fast={step_kind == 'fast'}",
        "--telemetry.logit_every=2", "--telemetry.layer_every=3", "--telemetry.probe_every=3",
        "--telemetry.probe_tokens=16", *overrides,
    )  # fmt: skip
    return run(cfg)


@pytest.fixture(scope="module")
def eager_and_fast(tmp_path_factory):
    """One tiny sigmoid arm of each step, every monitor on (the smoke preset has dropout 0). The
    softmax arm's compiled forward is checked below (test_jagged_lengths_share_one_graph): its
    four graphs (padding hint x max-logit flag) would double this fixture's compile time."""
    mp = pytest.MonkeyPatch()
    mp.setattr(fast, "COMPILE_BACKEND", "aot_eager")
    torch.set_num_threads(1)
    try:
        out = {k: tmp_path_factory.mktemp(k) for k in ("eager", "fast")}
        summaries = {k: _train(out[k], k) for k in out}
    finally:
        mp.undo()
    return out, summaries


def _history(out, arm: str) -> dict:
    return read_state(out / "smoke" / arm / "checkpoints" / "last")["history"]


def test_fast_step_follows_the_eager_loss_curve(eager_and_fast):
    out, summaries = eager_and_fast
    for arm in ("sigmoid",):
        assert summaries["fast"][arm]["status"] == "stable"
        eager, quick = _history(out["eager"], arm), _history(out["fast"], arm)
        assert len(quick["loss"]) == 6
        gap = curve_gap(eager["loss"], quick["loss"])
        assert gap["max_abs"] < 1e-4 * abs(gap["final_reference"]), (arm, gap)
        torch.testing.assert_close(quick["grad_norm"], eager["grad_norm"], rtol=1e-4, atol=1e-6)
        assert quick["max_logit"] == pytest.approx(eager["max_logit"], rel=1e-4)


def test_fast_step_logs_every_tag_the_eager_step_logs(eager_and_fast):
    out, _ = eager_and_fast
    for arm in ("sigmoid",):
        tags = {k: load_runs([out[k] / "smoke" / arm]) for k in out}
        assert set(tags["fast"].tag) == set(tags["eager"].tag), arm
        for tag in ("attn/max_logit", "update_ratio/layer_1", "train/grad_norm"):
            assert tag in set(tags["fast"].tag), (arm, tag)
        probe = tags["fast"][tags["fast"].tag.str.startswith("probe/jacobian")]
        assert set(probe.step) == {0, 3} and probe.value.map(math.isfinite).all()


def test_the_run_records_which_step_it_took(eager_and_fast):
    out, _ = eager_and_fast
    prov = {
        k: json.loads((out[k] / "smoke" / "sigmoid" / "provenance.json").read_text()) for k in out
    }
    assert prov["eager"]["fast_path"] is None
    assert prov["fast"]["fast_path"] == {"mode": "fullgraph", "note": ""}


def test_a_diverging_run_is_recorded_as_diverged_under_fast(tmp_path):
    cfg = tiny(
        tmp_path, "--train.steps=6", "--train.fast=True", "--train.lr=300",
        "--train.warmup_steps=0", "--model.init_scale=3",
    )  # fmt: skip
    s = run(cfg)["sigmoid"]
    assert s["status"] == "diverged" and s["divergence_step"] is not None
    summary = json.loads((arm_dir(tmp_path) / "summary.json").read_text())
    assert summary["status"] == "diverged"


@pytest.fixture
def breaking_backend():
    """A registered backend with a graph break in it, removed after the test."""

    def backend(*args, **kwargs):
        torch._dynamo.graph_break()
        return sigmoid_reference(*args, **kwargs)

    register("test-graph-break")(backend)
    yield "test-graph-break"
    attention._BACKENDS.pop("test-graph-break")


def _model(backend: str) -> Transformer:
    torch.manual_seed(0)
    cfg = C.ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0)
    return Transformer(cfg, 40, 32, backend)


def _batch(T: int, lengths: list[int]) -> Batch:
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(3, 40, (len(lengths), T), generator=g)
    return Batch(tokens, torch.full_like(tokens, -100), torch.tensor(lengths), [0])


def test_a_graph_break_falls_back_and_says_why(breaking_backend):
    model, said = _model(breaking_backend), []
    f = fast.FastForward(model, say=said.append)
    b = _batch(12, [12, 7])
    h = f(b, [12, 7])
    assert f.mode == "graph breaks" and f.note
    assert len(said) == 1 and "fullgraph=True failed" in said[0]
    torch.testing.assert_close(h, model(b.tokens_BT, b.lengths_B, return_hidden=True))


def test_jagged_lengths_share_one_graph(monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fast, "COMPILE_BACKEND", counter)
    model = _model("softmax")
    f = fast.FastForward(model, say=print)
    for T, lengths in ((20, [20, 9]), (24, [24, 24]), (17, [17, 5]), (31, [30, 31])):
        b = _batch(T, lengths)
        h = f(b, lengths)
        torch.testing.assert_close(h, model(b.tokens_BT, b.lengths_B, return_hidden=True))
    assert f.mode == "fullgraph"
    # One graph per padding hint (the softmax arm's SDPA takes no mask on unpadded batches),
    # none per length.
    assert counter.frame_count == 2


@pytest.mark.interpreter
def test_the_triton_kernel_arm_compiles_once_for_jagged_lengths(monkeypatch):
    """The sigmoid arm as the GPU runs it (the Triton op, here in the interpreter): fullgraph, one
    graph across lengths and padding, the same hidden states as the eager model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fast, "COMPILE_BACKEND", counter)
    torch.manual_seed(0)
    model = Transformer(
        C.ModelConfig(n_layers=1, d_model=64, n_heads=1, d_ff=64, dropout=0.0),
        40,
        32,
        "sigmoid-triton",
    )
    f = fast.FastForward(model, say=print)
    for T, lengths in ((20, [20, 9]), (24, [24, 24]), (31, [30, 31])):
        b = _batch(T, lengths)
        h = f(b, lengths)
        torch.testing.assert_close(h, model(b.tokens_BT, b.lengths_B, return_hidden=True))
    assert f.mode == "fullgraph" and counter.frame_count == 1


def test_the_long_gpu_presets_default_to_the_fast_step_and_one_flag_switches_it():
    for name, make in PRESETS.items():
        assert make().train.fast is (name in ("stress_8k", "paper")), name
    assert C.parse(["--preset", "paper", "--train.fast=False"]).train.fast is False
    assert C.parse(["--preset", "stress_8k", "--train.fast=False"]).train.fast is False
    assert C.parse(["--preset", "proxy", "--train.fast=True"]).train.fast is True
    assert C.parse(["--preset", "stress_8k_hot"]).train.deterministic is True


def test_stress_8k_takes_grouped_micro_batches_of_four_and_one_flag_undoes_it():
    cfg = C.parse(["--preset", "stress_8k"])
    assert (cfg.train.micro_batch, cfg.train.group_by_length) == (4, True)
    assert C.parse(["--preset", "stress_8k", "--train.micro_batch=1"]).train.micro_batch == 1
    for name, make in PRESETS.items():  # the other presets' steps are as recorded
        if name != "stress_8k":
            assert make().train.group_by_length is False or make().train.micro_batch == 1, name


def test_stress_8k_pads_to_multiples_of_128_and_one_flag_undoes_it():
    assert C.parse(["--preset", "stress_8k"]).data.pad_to_multiple == 128
    assert C.parse(["--preset", "stress_8k", "--data.pad_to_multiple=1"]).data.pad_to_multiple == 1
    for name, make in PRESETS.items():  # the other presets' batches are as recorded
        if name != "stress_8k":
            assert make().data.pad_to_multiple == 1, name


def test_fast_refuses_what_it_cannot_keep():
    with pytest.raises(C.ConfigError, match="train.fast"):
        C.parse(["--preset", "stress_8k", "--train.deterministic=True", "--train.fast=True"])
    with pytest.raises(C.ConfigError, match="--train.fast=False with --train.deterministic=True"):
        C.parse(["--preset", "stress_8k", "--train.deterministic=True"])  # the preset's fast step
    with pytest.raises(C.ConfigError, match="train.compile"):
        C.parse(["--preset", "proxy", "--train.compile=True", "--train.fast=True"])
    C.parse(["--preset", "stress_8k", "--train.deterministic=True", "--train.fast=False"])


def test_a_run_from_before_the_flag_resumes_with_it_on():
    saved = C.to_dict(C.parse(["--preset", "proxy"]))
    del saved["train"]["fast"]
    assert (
        config_changes(saved, C.to_dict(C.parse(["--preset", "proxy", "--train.fast=True"]))) == {}
    )
    changed = C.to_dict(C.parse(["--preset", "proxy", "--train.lr=0.01"]))
    assert "train.lr" in config_changes(saved, changed)


def test_curve_gap():
    gap = curve_gap([4.0, 3.0, 2.0], [4.0, 3.5, 2.2, 9.0], tail=2)
    assert gap["steps"] == 3 and gap["max_abs"] == pytest.approx(0.5)
    assert gap["tail_rel"] == pytest.approx((0.5 + 0.2) / 2 / 2.5)
    assert curve_gap([1.0, float("nan")], [1.0, 1.0])["tail_rel"] == math.inf
    with pytest.raises(ValueError, match="tail"):
        curve_gap([1.0], [1.0], tail=0)


def test_fast_vs_eager_splits_the_micro_batch_for_its_rounding_yardstick():
    """experiments/bench/fast_vs_eager.py: the yardstick run is the eager step with half the
    preset's micro-batch (same global batch); a preset with micro-batch 1 has nothing to split."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "bench" / "fast_vs_eager.py"
    spec = importlib.util.spec_from_file_location("fast_vs_eager", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.run_overrides("smoke", "fast") == ["--train.fast=True"]
    assert script.run_overrides("smoke", "eager_again") == ["--train.fast=False"]
    split = script.run_overrides("smoke", "eager_split")
    assert split == [
        "--train.fast=False",
        f"--train.micro_batch={PRESETS['smoke']().train.micro_batch // 2}",
    ]
    cfg = C.parse(["--preset", "smoke", *split])  # a valid split: the global batch divides
    assert cfg.train.global_batch % cfg.train.micro_batch == 0
    with pytest.raises(ValueError, match="micro_batch 1: nothing to split"):
        script.run_overrides("stress_8k_hot", "eager_split")
    with pytest.raises(ValueError, match="unknown run kind 'slow'"):
        script.run_overrides("smoke", "slow")


def test_the_fast_step_pads_the_head_and_the_eager_step_does_not(monkeypatch):
    """train.fast runs the head on rows padded to HEAD_ROW_MULTIPLE (the vocabulary, 515 here, is
    no multiple of 8), in the compiled step's loss as in the plain module; the eager step keeps 1."""
    from accelerate import Accelerator

    from stabilitylab.model import HEAD_ROW_MULTIPLE
    from stabilitylab.train import build

    seen = []
    real = fast.linear_cross_entropy_sum
    monkeypatch.setattr(
        fast, "linear_cross_entropy_sum",
        lambda *a, **kw: seen.append(kw.get("row_multiple")) or real(*a, **kw),
    )  # fmt: skip
    for on in (False, True):
        cfg = C.parse(["--preset", "smoke", f"--train.fast={on}"])
        model = build.build_model(cfg, "sigmoid-reference", 512 + C.N_SPECIAL_TOKENS)
        t = build.prepare(cfg, Accelerator(cpu=True), model, accum=1)
        assert t.raw.head.row_multiple == (HEAD_ROW_MULTIPLE if on else 1), on
        if on:
            tokens_BT = torch.randint(3, 515, (1, 16))
            labels_BT = torch.where(tokens_BT > 200, tokens_BT, -100)
            b = Batch(tokens_BT, labels_BT, torch.tensor([16]), [0])
            total = fast.summed_ce_fast(t.fast, t.raw, b, [16], nullcontext)
            assert torch.isfinite(total)
    assert seen == [HEAD_ROW_MULTIPLE]


def test_under_ddp_the_fast_step_compiles_with_the_bucket_breaks(tmp_path):
    """Several processes: accelerate wraps the model in DDP, which fullgraph=True refuses; the
    fast forward compiles it with dynamo's bucket breaks from the start, says so, and computes
    the plain model's output (one gloo process here)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cfg = C.parse(["--preset", "smoke"])
    model = Transformer(cfg.model, 512 + C.N_SPECIAL_TOKENS, 32, "sigmoid-reference")
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        said = []
        f = fast.FastForward(DistributedDataParallel(model), say=said.append)
        assert f.mode == "graph breaks" and f.note == fast.DDP_NOTE and fast.DDP_NOTE in said[0]
        tokens_BT = torch.randint(3, 515, (2, 32))
        lengths_B = torch.tensor([32, 20])
        b = Batch(tokens_BT, torch.full_like(tokens_BT, -100), lengths_B, [0, 1])
        h = f(b, [32, 20])
        torch.testing.assert_close(h, model(tokens_BT, lengths_B, return_hidden=True))
        assert f.mode == "graph breaks"
    finally:
        dist.destroy_process_group()
