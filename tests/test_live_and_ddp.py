"""Live TensorBoard over HTTP while a run is written; two CPU processes through accelerate."""

import json
import os
import socket
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

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    return [
        *launcher,
        "experiments/stress_8k.py",
        "--preset",
        "smoke",
        "--arm",
        "softmax",
        f"--out_dir={out_dir}",
        "--report=False",
        "--train.steps=12",
        "--train.micro_batch=4",
    ]


@pytest.mark.slow
def test_two_cpu_processes_match_one_at_the_same_global_batch(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CPU-process test")
    one = subprocess.run(
        _smoke_cmd(tmp_path / "one", [sys.executable]),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]
    two = subprocess.run(
        _smoke_cmd(tmp_path / "two", launcher),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    d1, d2 = tmp_path / "one" / "smoke" / "softmax", tmp_path / "two" / "smoke" / "softmax"
    assert json.loads((d2 / "provenance.json").read_text())["world_size"] == 2
    last2 = d2 / "checkpoints" / "last"
    manifest = json.loads((last2 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and sorted(manifest["files"]) == [
        "rng0.pt",
        "rng1.pt",
        "state.pt",
    ]
    assert "processes=2" in two.stdout + two.stderr
    h1 = read_state(d1 / "checkpoints" / "last")["history"]["loss"]
    h2 = read_state(last2)["history"]["loss"]
    assert len(h1) == len(h2) == 12
    torch.testing.assert_close(torch.tensor(h2), torch.tensor(h1), rtol=1e-5, atol=1e-6)
    assert h1[-1] < h1[0]
