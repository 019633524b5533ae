"""The multi-GPU launch configs of experiments/launch/ on two CPU processes (gloo): DDP with the
fast step (``multi_gpu.yaml``), FSDP2 (``fsdp.yaml``): each matches one process's curve at the
same global batch; an FSDP run stopped by SIGTERM resumes bit for bit; every rank writes its
shard; the FSDP settings and resumes the trainer does not run are refused in one line.

Every run is the smoke preset's sigmoid arm at micro-batch 4 (two micro-batches per process on
two processes), dropout 0 where curves are compared across process counts (dropout is drawn per
process), 0.1 where a resume must carry the random state."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stabilitylab.cli import USAGE_ERROR, kv_main, train_main
from stabilitylab.config import parse
from stabilitylab.train import checkpoint, fast, resume, run
from stabilitylab.train.checkpoint import CheckpointError, read_state
from tests.launch import (
    AOT_EAGER_TRAIN,
    ENV,
    ROOT,
    TRAIN,
    accelerate_launch,
    launch,
    sigterm_after_first_checkpoint,
)

DDP_YAML, FSDP_YAML = "experiments/launch/multi_gpu.yaml", "experiments/launch/fsdp.yaml"
SMOKE = ["--preset", "smoke", "--arm=sigmoid", "--report=False", "--train.micro_batch=4",
         "--telemetry.probe_every=0", "--telemetry.logit_every=0"]  # fmt: skip
CURVE = [*SMOKE, "--train.steps=8", "--train.warmup_steps=2", "--model.dropout=0"]
RESUME_STEPS = 16
RESUME = [*SMOKE, f"--train.steps={RESUME_STEPS}", "--train.checkpoint_every=2",
          "--model.dropout=0.1"]  # fmt: skip
# Two processes against one: the same global batch, its micro-batches summed in another order
# (and under DDP / FSDP reduced across processes), so float32 rounding apart.
RTOL, ATOL = 1e-5, 1e-6


def _cmd(launcher: list[str], script: str, out: Path, args: list[str]) -> list[str]:
    return [*launcher, script, *args, f"--out_dir={out}"]


def _bf16(launcher: list[str]) -> list[str]:
    """The launch with the config's own mixed precision (bf16) instead of ``no``."""
    i = launcher.index("--mixed_precision")
    return launcher[:i] + launcher[i + 2 :]


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (arm dir, the launch's output): one process, eager, in float32 and under bf16
    autocast; two processes: FSDP eager under fsdp.yaml's bf16, FSDP fast, DDP fast."""
    if torch.cuda.is_available():
        pytest.skip("CPU-process test")
    root = tmp_path_factory.mktemp("curves")
    fast_step = [*CURVE, "--train.fast=True"]
    _train_here([*CURVE, f"--out_dir={root / 'one'}"])
    out = {"one": (root / "one" / "smoke" / "sigmoid", "")}
    runs = {
        # a process of its own: accelerate's state keeps the first mixed precision it was given
        "one_bf16": ([sys.executable], TRAIN, [*CURVE, "--train.precision=bf16"]),
        "fsdp_bf16": (_bf16(accelerate_launch(FSDP_YAML)), TRAIN, CURVE),
        "fsdp_fast": (accelerate_launch(FSDP_YAML), AOT_EAGER_TRAIN, fast_step),
        "ddp_fast": (accelerate_launch(DDP_YAML), AOT_EAGER_TRAIN, fast_step),
    }
    for name, (launcher, script, args) in runs.items():
        done = launch(_cmd(launcher, script, root / name, args))
        out[name] = (root / name / "smoke" / "sigmoid", done.stdout + done.stderr)
    return out


def _train_here(argv: list[str]) -> None:
    """One process in this one, on one thread as the launched ones (``tests.launch.ENV``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(parse(argv))
    finally:
        torch.set_num_threads(threads)


def _state(arm_dir: Path) -> dict:
    return read_state(arm_dir / "checkpoints" / "last")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "reference", "says", "rtol"),
    [
        # under bf16 autocast the two reduction orders round apart by ~2e-5 relative
        ("fsdp_bf16", "one_bf16", "sharded=FSDP2", 1e-4),
        ("fsdp_fast", "one", fast.FSDP_NOTE, RTOL),
        ("ddp_fast", "one", fast.DDP_NOTE, RTOL),
    ],
)
def test_two_processes_match_one_at_the_same_global_batch(curves, name, reference, says, rtol):
    (one, _), (two, output) = curves[reference], curves[name]
    assert "processes=2" in output and says in output
    assert json.loads((two / "provenance.json").read_text())["world_size"] == 2
    s1, s2 = _state(one), _state(two)
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(s1["history"][key]), torch.tensor(s2["history"][key])
        assert len(a) == len(b) == 8
        torch.testing.assert_close(b, a, rtol=rtol, atol=ATOL, msg=key)
    assert s1["history"]["loss"][-1] < s1["history"]["loss"][0], "the curve must move"
    # The full weights, read back in one process (from DCP's shards under FSDP). Not compared
    # value by value: AdamW moves a weight whose gradient is rounding noise by about lr either
    # way, so after 8 steps the two runs' weights differ by up to 1e-4 where their curves agree.
    assert {k: w.shape for k, w in s2["model"].items()} == {
        k: w.shape for k, w in s1["model"].items()
    }


@pytest.mark.slow
def test_under_bf16_the_fsdp_forward_runs_under_autocast_over_float32_weights(curves):
    """fsdp.yaml's bf16 is autocast, as on one GPU (not accelerate's FSDP policy, which would
    cast the weights): the first loss moves from the float32 run's by bf16 rounding (the same
    weights and batch) and the weights stay float32."""
    one, (two, output) = _state(curves["one"][0]), curves["fsdp_bf16"]
    assert "mixed_precision=bf16" in output
    bf16 = _state(two)
    a, b = one["history"]["loss"][0], bf16["history"]["loss"][0]
    # bf16 moved it by 9e-6 relative here; two float32 runs' first losses agree to 1e-7
    assert abs(b - a) > 1e-6 * a, "the forward ran in float32"
    assert {w.dtype for w in bf16["model"].values()} == {torch.float32}


@pytest.mark.slow
def test_every_rank_writes_its_shard_of_model_and_optimizer(curves):
    last = curves["fsdp_bf16"][0] / "checkpoints" / "last"
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
    assert sorted(manifest["files"]) == [
        "model/.metadata",
        "model/__0_0.distcp",
        "model/__1_0.distcp",
        "optimizer/.metadata",
        "optimizer/__0_0.distcp",
        "optimizer/__1_0.distcp",
        "rng0.pt",
        "rng1.pt",
        "state.pt",
    ]
    assert sorted(torch.load(last / "state.pt", weights_only=True)) == ["history", "step"]
    for f in ("model/__0_0.distcp", "model/__1_0.distcp"):
        assert manifest["files"][f]["bytes"] > 0
    assert manifest["files"]["model/__0_0.distcp"] != manifest["files"]["model/__1_0.distcp"]


@pytest.mark.slow
def test_a_sharded_checkpoint_is_refused_by_a_run_without_fsdp(curves, tmp_path, capsys):
    """One ``error:`` line before any work; the run dir is left as it was."""
    out = tmp_path / "copy"
    shutil.copytree(curves["fsdp_fast"][0].parent, out / "smoke")
    before = (out / "smoke" / "sigmoid" / "checkpoints" / "last" / "manifest.json").read_bytes()
    code = None
    try:
        train_main([*CURVE, "--train.steps=10", f"--out_dir={out}"])
    except SystemExit as e:
        code = e.code
    assert code == USAGE_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint "), err
    assert "holds sharded weights and this run is not under FSDP" in err[0]
    assert (out / "smoke" / "sigmoid" / "checkpoints" / "last" / "manifest.json").read_bytes() == (
        before
    )


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(curves, tmp_path):
    """The two-process FSDP checkpoint at step 8, resumed by one FSDP process (DCP reshards the
    weights and AdamW's moments) for two more steps, continues as the one-process run does."""
    for name in ("one", "fsdp_fast"):
        shutil.copytree(curves[name][0].parent, tmp_path / name / "smoke")
    more = [*CURVE, "--train.steps=10"]
    _train_here([*more, f"--out_dir={tmp_path / 'one'}"])
    resumed = launch(_cmd(accelerate_launch(FSDP_YAML, 1), TRAIN, tmp_path / "fsdp_fast", more))
    said = resumed.stdout + resumed.stderr
    assert "processes=1 sharded=FSDP2" in said and "resumed from" in said
    assert "written by 2 processes, this run has 1" in said
    one, fsdp = (
        _state(tmp_path / n / "smoke" / "sigmoid")["history"] for n in ("one", "fsdp_fast")
    )
    for key in ("loss", "grad_norm"):
        assert len(one[key]) == len(fsdp[key]) == 10
        torch.testing.assert_close(torch.tensor(fsdp[key]), torch.tensor(one[key]), rtol=RTOL,
                                   atol=ATOL, msg=key)  # fmt: skip


@pytest.mark.slow
def test_a_full_checkpoint_is_refused_under_fsdp(curves):
    one = curves["one"][0]
    cfg = parse([*CURVE, f"--out_dir={one.parent.parent}"])
    config = json.loads((one / "config.json").read_text())
    with pytest.raises(CheckpointError, match="holds full weights and this run is under FSDP"):
        resume.plan(cfg, one, config, sharded=True)
    assert resume.plan(cfg, one, config, sharded=False).kind == "done"


@pytest.mark.slow
def test_an_fsdp_run_stopped_by_sigterm_resumes_bit_for_bit(tmp_path):
    """The launcher gets SIGTERM once the first checkpoint is written, as a scheduler sends it;
    torchrun passes it to both ranks, which agree on the step to stop after, checkpoint and exit
    75; the same command resumes, and the curve and the weights equal an uninterrupted run's."""
    if torch.cuda.is_available():
        pytest.skip("CPU-process test")
    straight = tmp_path / "straight"
    launch(_cmd(accelerate_launch(FSDP_YAML), TRAIN, straight, RESUME))
    stopped = tmp_path / "stopped"
    cmd = _cmd(accelerate_launch(FSDP_YAML), TRAIN, stopped, RESUME)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    arm = stopped / "smoke" / "sigmoid"
    sigterm_after_first_checkpoint(proc, arm)
    _, err = proc.communicate(timeout=240)
    summary = json.loads((arm / "summary.json").read_text())
    assert summary["status"] == "interrupted", err.decode()[-3000:]
    assert 2 <= summary["steps"] < RESUME_STEPS
    assert checkpoint.read_manifest(arm / "checkpoints" / "last")["step"] == summary["steps"]

    resumed = launch(_cmd(accelerate_launch(FSDP_YAML), TRAIN, stopped, RESUME))
    assert f"at step {summary['steps']}" in resumed.stdout + resumed.stderr
    a, b = _state(straight / "smoke" / "sigmoid"), _state(arm)
    assert a["step"] == b["step"] == RESUME_STEPS
    assert a["history"]["loss"] == b["history"]["loss"], "the loss curve must match to the bit"
    assert a["history"]["grad_norm"] == b["history"]["grad_norm"]
    for name, w in a["model"].items():
        assert torch.equal(w, b["model"][name]), name


def _fsdp_env(monkeypatch, **overrides) -> None:
    """The environment ``accelerate launch --config_file fsdp.yaml`` gives its processes, with
    ``overrides`` (FSDP_* variables)."""
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_ACTIVATION_CHECKPOINTING": "false",
        **overrides,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == USAGE_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config "), err
    return err[0]


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"FSDP_VERSION": "1"}, "fsdp_config.fsdp_version: 1"),
        ({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}, "fsdp_config.fsdp_auto_wrap_policy: NO_WRAP"),
        ({"FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block"}, "on ['GPT2Block']"),
        ({"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}, "fsdp_config.fsdp_state_dict_type"),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_config.fsdp_offload_params"),
        ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_config.fsdp_activation_checkpointing"),
        ({}, "fsdp_config: FSDP was asked (ACCELERATE_USE_FSDP) in a process that no launcher"),
    ],
)
def test_fsdp_settings_the_trainer_does_not_run_are_refused_in_one_line(
    monkeypatch, capsys, tmp_path, overrides, names
):
    _fsdp_env(monkeypatch, **overrides)
    line = _error_line(capsys, [*CURVE, f"--out_dir={tmp_path}"])
    assert names in line
    assert not (tmp_path / "smoke").exists(), "refused before any work"


def test_the_kv_studys_decoder_is_refused_under_fsdp(monkeypatch, capsys, tmp_path):
    _fsdp_env(monkeypatch)
    with pytest.raises(SystemExit) as e:
        kv_main(["--preset", "tiny", "--cells", "sm-rope", f"--out_dir={tmp_path}"])
    assert e.value.code == USAGE_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config task: the KV study's decoder"), err


def test_the_live_probe_is_refused_under_fsdp(monkeypatch, capsys, tmp_path):
    _fsdp_env(monkeypatch)
    line = _error_line(capsys, [*CURVE, "--telemetry.probe_every=50", f"--out_dir={tmp_path}"])
    assert "telemetry.probe_every: 50" in line and "--telemetry.probe_every=0" in line
