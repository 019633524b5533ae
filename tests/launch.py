"""Several CPU processes through ``accelerate launch``: the commands the multi-process tests run.

Two gloo processes on CPU take ``--multi_gpu`` (or a launch config of the GPU kinds, DDP or FSDP)
with the trainer's ``Accelerator(cpu=True)``; ``--cpu`` would start one process here (multi-CPU
mode expects MPI). The fast step compiles with the ``aot_eager`` backend (``AOT_EAGER_TRAIN``):
dynamo and AOT autograd trace as for inductor, no C++ is generated."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TRAIN = "experiments/stress_8k.py"
AOT_EAGER_TRAIN = "tests/train_aot_eager.py"
"""``stress_8k.py`` with the fast step's compile backend set to aot_eager."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(config_file: str | None = None, num_processes: int = 2) -> list[str]:
    """accelerate launch with gloo processes on CPU: the launch config's distributed type
    (``experiments/launch/*.yaml``) or plain ``--multi_gpu`` (DDP); no mixed precision."""
    kind = ["--config_file", config_file] if config_file else ["--multi_gpu", "--num_machines", "1"]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *kind,
        "--num_processes",
        str(num_processes),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
    ]


def launch(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; it must exit 0."""
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def sigterm_after_first_checkpoint(proc: subprocess.Popen, arm_dir: Path) -> None:
    """SIGTERM to ``proc`` once ``arm_dir`` holds its first checkpoint, as a scheduler sends it.
    The wait ends with the checkpoint or with the process, not with a clock: a run that ends
    before its first checkpoint fails here, a slow machine only waits longer."""
    last = arm_dir / "checkpoints" / "last"
    while not last.exists() and proc.poll() is None:
        time.sleep(0.02)
    assert last.exists(), f"the run ended (exit {proc.returncode}) before its first checkpoint"
    proc.send_signal(signal.SIGTERM)
