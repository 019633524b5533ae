"""The spine end to end on CPU: paired smoke run, divergence as an outcome, resume to the bit."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from stabilitylab import cli, tags
from stabilitylab import config as C
from stabilitylab.attention import SDPA_KERNELS
from stabilitylab.cli import train_main
from stabilitylab.train import build, run
from stabilitylab.train.checkpoint import read_state
from tests.launch import sigterm_after_first_checkpoint

ROOT = Path(__file__).resolve().parent.parent
EXIT_INTERRUPTED = 75  # stabilitylab.cli, the exit code experiments/stress_8k.py returns


def smoke(tmp_path, *overrides):
    # The live probe runs extra forward passes; the fault-injection tests count forward calls.
    return C.parse(
        [
            "--preset",
            "smoke",
            f"--out_dir={tmp_path}",
            "--report=False",
            "--telemetry.probe_every=0",
            *overrides,
        ]
    )


def read_summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def last_state(arm_dir: Path) -> dict:
    """The verified state of an arm's last checkpoint (model, optimizer, step, history)."""
    return read_state(arm_dir / "checkpoints" / "last")


def test_paired_smoke_run_writes_everything(tmp_path):
    cfg = smoke(
        tmp_path,
        "--train.steps=30",
        "--telemetry.logit_every=10",
        "--telemetry.layer_every=10",
        "--report=True",
    )
    out = run(cfg)
    assert set(out) == {"softmax", "sigmoid"}
    hashes = set()
    for arm in ("softmax", "sigmoid"):
        d = tmp_path / "smoke" / arm
        s = read_summary(d)
        assert s["status"] == "stable" and s["steps"] == 30 and s["arm"] == arm
        assert math.isfinite(s["final_loss"]) and s["max_logit"] > 0 and s["max_grad_norm"] > 0
        hashes.add(s["init_hash"])
        conf = json.loads((d / "config.json").read_text())
        assert conf["arm"] == arm and conf["backend"] == (
            "softmax" if arm == "softmax" else "sigmoid-reference"
        )
        prov = json.loads((d / "provenance.json").read_text())
        assert prov["torch"] == torch.__version__ and "git_commit" in prov and "git_dirty" in prov
        assert prov["autotune"] == {}  # the CPU interpreter does not autotune
        # Which SDPA kernel each call form of the softmax backend dispatched to, at this shape.
        kernels = prov["sdpa_kernels"]
        if arm == "softmax":
            assert set(kernels) == {"unpadded", "padded"}
            assert set(kernels.values()) <= set(SDPA_KERNELS.values())
        else:
            assert kernels is None
        assert len(list(d.glob("events.out.tfevents.*"))) == 1
        assert last_state(d)["step"] == 30
        vocab = json.loads((d / "vocab.json").read_text())
        assert vocab["gene_token_offset"] == C.N_SPECIAL_TOKENS and len(vocab["genes"]) == 512
        assert conf["data"]["n_genes"] == 512 and conf["mixed_precision"] == "no"
    assert len(hashes) == 1, "both arms must start from identical weights"
    report = tmp_path / "smoke" / "report"
    for name in ("report.md", "summary.csv", "scalars.csv", "figure.png", "heatmap.png"):
        assert (report / name).stat().st_size > 0, name
    assert "softmax" in (report / "report.md").read_text()


def _history(tmp_path, *overrides):
    run(smoke(tmp_path, "--arm=sigmoid", "--train.steps=25", "--model.dropout=0.1", *overrides))
    return last_state(tmp_path / "smoke" / "sigmoid")


def test_live_probe_does_not_change_the_trajectory(tmp_path):
    off = _history(tmp_path / "off")
    on = _history(tmp_path / "on", "--telemetry.probe_every=5", "--telemetry.probe_tokens=64")
    assert on["history"]["loss"] == off["history"]["loss"]
    for name, t in off["model"].items():
        assert torch.equal(t, on["model"][name]), name
    from stabilitylab.analysis.events import load_runs

    df = load_runs([tmp_path / "on" / "smoke" / "sigmoid"])
    probe = df[df.tag == tags.layer(tags.JACOBIAN_LAYER, 0)]
    assert sorted(probe.step) == [0, 5, 10, 15, 20] and (probe.value > 0).all()


GOLDEN = ROOT / "tests" / "golden" / "smoke_softmax_loss.json"


def test_smoke_loss_curve_matches_the_committed_golden_curve(tmp_path):
    """A short CPU run reproduces the committed curve (regenerate deliberately when the model,
    data or optimizer change: python tests/golden/make_golden.py)."""
    golden = json.loads(GOLDEN.read_text())
    run(smoke(tmp_path, "--arm=softmax", f"--train.steps={len(golden['loss'])}"))
    loss = last_state(tmp_path / "smoke" / "softmax")["history"]["loss"]
    torch.testing.assert_close(
        torch.tensor(loss), torch.tensor(golden["loss"]), rtol=1e-4, atol=1e-4
    )


def inject_fault(monkeypatch, module: str, value: float, bad_calls) -> None:
    """Make ``model.<module>``'s output ``* value`` on the forward calls for which
    ``bad_calls(n)`` holds (n counts that module's calls from 1)."""
    build_model, calls = build.build_model, {"n": 0}

    def poison(_mod, _inp, out):
        calls["n"] += 1
        return out * value if bad_calls(calls["n"]) else out

    def build_with_fault(cfg, backend, vocab):
        model = build_model(cfg, backend, vocab)
        model.get_submodule(module).register_forward_hook(poison)
        return model

    monkeypatch.setattr(build, "build_model", build_with_fault)


def test_nonfinite_is_recorded_with_module_and_forensic_checkpoint(tmp_path, monkeypatch):
    inject_fault(monkeypatch, "blocks.1.attn", float("inf"), lambda n: n > 7)
    cfg = smoke(tmp_path, "--arm=softmax", "--train.steps=20", "--train.checkpoint_every=2")
    s = run(cfg)["softmax"]
    d = tmp_path / "smoke" / "softmax"
    assert s["status"] == "diverged" and s["divergence_step"] == 7
    assert s["first_nonfinite_module"] == "blocks.1.attn"
    assert last_state(d)["step"] == 6  # the periodic checkpoint before the divergence
    assert read_summary(d)["status"] == "diverged"
    forensic = read_state(d / "checkpoints" / "forensic_step7")
    assert all(torch.isfinite(p).all() for p in forensic["model"].values()), (
        "weights before the bad update"
    )
    assert forensic["step"] == 7 and forensic["history"]["steps"] == list(range(7))
    manifest = json.loads((d / "checkpoints" / "forensic_step7" / "manifest.json").read_text())
    assert manifest["extra"]["divergence"]["module"] == "blocks.1.attn"
    assert manifest["extra"]["batch_indices"] == [7 * 16, 16]

    from stabilitylab.analysis.events import load_runs

    df = load_runs([d])
    assert (df[df.tag == tags.NONFINITE].step == 7).any()


def test_the_script_exits_0_for_a_diverged_run(tmp_path, monkeypatch):
    """Divergence is a result, not a failure: only an interrupted run exits non-zero."""
    inject_fault(monkeypatch, "blocks.1.attn", float("inf"), lambda n: n > 2)
    argv = [
        "--preset",
        "smoke",
        "--arm=softmax",
        f"--out_dir={tmp_path}",
        "--report=False",
        "--telemetry.probe_every=0",
        "--train.steps=6",
    ]
    assert train_main(argv) == 0
    assert read_summary(tmp_path / "smoke" / "softmax")["status"] == "diverged"
    assert cli.EXIT_INTERRUPTED == EXIT_INTERRUPTED


def test_continue_policy_runs_through_nonfinite_steps(tmp_path, monkeypatch):
    inject_fault(monkeypatch, "blocks.0.ff", float("nan"), lambda n: n in (4, 5))
    cfg = smoke(tmp_path, "--arm=sigmoid", "--train.steps=12", "--train.on_divergence=continue")
    s = run(cfg)["sigmoid"]
    assert s["status"] == "diverged" and s["divergence_step"] == 3 and s["steps"] == 12
    assert s["nonfinite_steps"] == 1 and math.isfinite(s["final_loss"])


def _cmd(out_dir, steps):
    return [
        sys.executable,
        "experiments/stress_8k.py",
        "--preset",
        "smoke",
        "--arm",
        "sigmoid",
        f"--out_dir={out_dir}",
        "--report=False",
        f"--train.steps={steps}",
        "--model.dropout=0.1",
        "--train.checkpoint_every=10",
        "--telemetry.logit_every=7",
        # Smaller cells and batch than the smoke preset (two micro-batches, so the accumulation
        # path is resumed too): the test is about the resume, not the model.
        "--data.context_len=64",
        "--train.global_batch=8",
        "--train.micro_batch=4",
    ]


def test_sigterm_then_resume_is_bitwise_identical(tmp_path):
    steps = 60
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    straight = subprocess.run(
        _cmd(tmp_path / "a", steps), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr[-2000:]

    proc = subprocess.Popen(
        _cmd(tmp_path / "b", steps),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    b_dir = tmp_path / "b" / "smoke" / "sigmoid"
    sigterm_after_first_checkpoint(proc, b_dir)
    proc.communicate(timeout=240)
    assert proc.returncode == EXIT_INTERRUPTED
    first = read_summary(b_dir)
    assert first["status"] == "interrupted" and 10 <= first["steps"] < steps, first

    resumed = subprocess.run(
        _cmd(tmp_path / "b", steps), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    a, b = last_state(tmp_path / "a" / "smoke" / "sigmoid"), last_state(b_dir)
    assert a["step"] == b["step"] == steps
    assert a["history"]["loss"] == b["history"]["loss"], "loss curve must match to the last bit"
    assert a["history"]["grad_norm"] == b["history"]["grad_norm"]
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name


def test_clipping_is_applied_only_when_asked(tmp_path):
    def losses(name, *overrides):
        run(smoke(tmp_path / name, "--arm=softmax", "--train.steps=6", *overrides))
        return last_state(tmp_path / name / "smoke" / "softmax")["history"]["loss"]

    off = losses("off")
    assert losses("loose", "--train.clip_grad=1e9") == off  # coefficient 1: the same update
    tight = losses("tight", "--train.clip_grad=1e-4")
    assert tight[0] == off[0] and tight[-1] != off[-1]


CRASHING_RUN = """
import sys
from stabilitylab import attention
from stabilitylab.cli import train_main

calls, plain = [0], attention.get_backend("softmax")


def crashing(*args, **kwargs):
    calls[0] += 1
    if calls[0] > 20:
        raise RuntimeError("injected failure in the attention backend")
    return plain(*args, **kwargs)


attention._BACKENDS["softmax"] = crashing
sys.exit(train_main())
"""


def test_a_crash_with_loader_workers_exits_instead_of_hanging(tmp_path):
    """An exception mid-run with DataLoader workers (the GPU default: 2) ends the process with the
    traceback. The workers ignore SIGTERM, and the traceback kept their iterator alive until
    exit, where multiprocessing waited on them forever (seen on the GPU)."""
    script = tmp_path / "crashing_run.py"
    script.write_text(CRASHING_RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), "--preset", "smoke", "--arm=softmax", "--num_workers=2",
           f"--out_dir={tmp_path}", "--report=False", "--train.steps=40"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "injected failure in the attention backend" in done.stderr


def test_padding_to_a_multiple_leaves_both_arms_losses(tmp_path):
    """data.pad_to_multiple only adds masked positions: with one cell per micro-batch (rounded
    from 32-128 tokens up to 64 or 128), both arms' first steps give the losses of unpadded
    batches to float32 rounding."""
    steps = ["--train.steps=3", "--train.micro_batch=1", "--train.global_batch=8"]
    plain = smoke(tmp_path / "plain", *steps)
    padded = smoke(tmp_path / "padded", *steps, "--data.pad_to_multiple=64")
    run(plain)
    run(padded)
    for arm in ("softmax", "sigmoid"):
        a = last_state(tmp_path / "plain" / "smoke" / arm)["history"]["loss"]
        b = last_state(tmp_path / "padded" / "smoke" / arm)["history"]["loss"]
        assert len(a) == len(b) == 3
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0), (arm, a, b)
