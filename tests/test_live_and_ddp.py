"""Live TensorBoard over HTTP while a run is written; two CPU processes through accelerate."""

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

from stabilitylab import tags
from stabilitylab.train.checkpoint import read_state
from tests.launch import ENV, ROOT, accelerate_launch, free_port, launch


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_tensorboard_server_reads_scalars_while_the_run_goes_on(tmp_path):
    run = subprocess.Popen(
        [
            sys.executable,
            "experiments/stress_8k.py",
            "--preset",
            "smoke",
            "--arm",
            "softmax",
            f"--out_dir={tmp_path}",
            "--report=False",
            "--train.steps=100000",
            "--telemetry.flush_secs=1",
            "--telemetry.log_every=2",
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port = free_port()
    tb = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(tmp_path / "smoke"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--reload_interval",
            "1",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    q = urllib.parse.urlencode({"run": "softmax", "tag": tags.LOSS})
    try:
        seen: list[list] = []
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                runs = get_json(f"{base}/tags")
                if tags.LOSS in runs.get("softmax", {}):
                    seen.append(get_json(f"{base}/scalars?{q}"))
                    if len(seen) >= 2 and len(seen[-1]) > len(seen[0]) > 0:
                        break
            except OSError:
                pass
            time.sleep(1)
        assert run.poll() is None, "the run must still be going"
        assert len(seen) >= 2 and len(seen[-1]) > len(seen[0]) > 0, (
            f"no live growth: {[len(s) for s in seen]}"
        )
        wall, step, value = seen[-1][-1]
        assert step > 0 and 0 < value < 20
        assert tags.GRAD_NORM in get_json(f"{base}/tags")["softmax"]
    finally:
        run.terminate()
        tb.terminate()
        run.wait(60)
        tb.wait(60)


def _smoke_cmd(out_dir, launcher):
    """The smoke preset's paired run (both arms), 12 steps, deterministic, without dropout: the
    settings under which one process and two must give the same curves."""
    return [
        *launcher,
        "experiments/stress_8k.py",
        "--preset",
        "smoke",
        f"--out_dir={out_dir}",
        "--report=False",
        "--train.steps=12",
        "--train.micro_batch=4",
        "--train.deterministic=True",
        "--model.dropout=0",
    ]


def _launch(out_dir: Path, launcher: list[str]) -> subprocess.CompletedProcess:
    return launch(_smoke_cmd(out_dir, launcher))


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The paired smoke run once with one process and twice with two; name -> (out_dir/smoke,
    the finished launch)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-process test")
    root = tmp_path_factory.mktemp("ddp")
    launchers = {
        "one": [sys.executable],
        "two": accelerate_launch(),
        "two_again": accelerate_launch(),
    }
    return {
        name: (root / name / "smoke", _launch(root / name, launcher))
        for name, launcher in launchers.items()
    }


def _history(smoke_dir: Path, arm: str) -> dict:
    return read_state(smoke_dir / arm / "checkpoints" / "last")["history"]


@pytest.mark.slow
def test_two_cpu_processes_match_one_at_the_same_global_batch(smoke_runs):
    (one, _), (two, launched) = smoke_runs["one"], smoke_runs["two"]
    d1, d2 = one / "softmax", two / "softmax"
    assert json.loads((d2 / "provenance.json").read_text())["world_size"] == 2
    last2 = d2 / "checkpoints" / "last"
    manifest = json.loads((last2 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and sorted(manifest["files"]) == [
        "rng0.pt",
        "rng1.pt",
        "state.pt",
    ]
    assert "processes=2" in launched.stdout + launched.stderr
    h1 = read_state(d1 / "checkpoints" / "last")["history"]["loss"]
    h2 = read_state(last2)["history"]["loss"]
    assert len(h1) == len(h2) == 12
    torch.testing.assert_close(torch.tensor(h2), torch.tensor(h1), rtol=1e-5, atol=1e-6)
    assert h1[-1] < h1[0]


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["softmax", "sigmoid"])
def test_deterministic_two_processes_repeat_bit_for_bit_and_match_one(smoke_runs, arm):
    """train.deterministic under DDP: gloo's all-reduce sums in a fixed order for a fixed layout,
    so two launches of two processes give the same curves bit for bit, and one process's curve
    within float32 rounding (its accumulation adds the micro-batches in another order)."""
    one, two, again = (smoke_runs[k][0] for k in ("one", "two", "two_again"))
    expected = {"softmax": "softmax-reference", "sigmoid": "sigmoid-reference"}[arm]
    for smoke_dir in (one, two, again):
        config = json.loads((smoke_dir / arm / "config.json").read_text())
        assert config["train"]["deterministic"] is True
        assert config["backend"] == expected
        assert config["model"]["dropout"] == 0
    h2, h2_again = _history(two, arm), _history(again, arm)
    for key in ("loss", "grad_norm"):
        assert len(h2[key]) == 12
        assert torch.equal(torch.tensor(h2[key]), torch.tensor(h2_again[key])), key
    loss1, loss2 = torch.tensor(_history(one, arm)["loss"]), torch.tensor(h2["loss"])
    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
