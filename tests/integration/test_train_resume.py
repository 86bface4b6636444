"""Train, stop and resume the default project through `forge train` / `forge resume`.

The guarantee under test: a run stopped after its step-20 checkpoint (SIGTERM or SIGKILL)
and continued with `forge resume` ends with bit-identical weights and optimizer state to
the same run trained straight through.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.faults import hold_env
from tests.helpers import REPO, run_forge
from tests.integration.conftest import SMALL
from tests.train.common import assert_same_tensors, component_state

pytestmark = pytest.mark.integration


def start_forge(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A fresh ``forge ARGS`` in the background, its environment this process's and ``env``
    (tests.faults' ``hold_env``, say)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen(
        [sys.executable, "-m", "forge.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"forge exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.05)


def start_held(
    *args: str, cwd: Path, saved: int, timeout: float = 300
) -> tuple[subprocess.Popen, Path]:
    """A fresh ``forge ARGS`` in the background, and its run directory, once the checkpoint of
    step ``saved`` is committed and rank 0 waits at the start of the next save (tests.faults'
    hold): a signal sent now lands there however busy the machine, where a small model's run
    may otherwise end between two looks at its checkpoints."""
    marker = Path(tempfile.mkdtemp(prefix="forge-held-")) / "held"
    proc = start_forge(*args, cwd=cwd, env=hold_env(after=saved, marker=marker))
    run_dir = Path(proc.stdout.readline().strip())
    wait_for(marker, proc, timeout=timeout)
    assert (run_dir / "checkpoints" / f"checkpoint-{saved:06d}").is_dir()
    return proc, run_dir


def final_state(run_dir: Path, step: int = 40) -> tuple[dict, dict]:
    ckpt = run_dir / "checkpoints" / f"checkpoint-{step:06d}"
    weights = load_file(ckpt / "model.safetensors")
    return weights, component_state(ckpt, "optimizer")


def train_straight(project: Path, *extra: str) -> Path:
    result = run_forge("train", "-p", str(project), *SMALL, *extra)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0])


def stop_and_resume(project: Path, sig: int, *extra: str) -> Path:
    proc, run_dir = start_held("train", "-p", str(project), *SMALL, *extra, cwd=REPO, saved=20)
    proc.send_signal(sig)
    proc.wait(timeout=300)
    if sig in (signal.SIGTERM, signal.SIGINT):
        stderr = proc.stderr.read()
        assert proc.returncode == 128 + sig, stderr  # 143 / 130
        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "interrupted"
        assert record["signal"] == signal.Signals(sig).name
        # one message says where it stopped and how to go on; no traceback beside it
        assert stderr.count(f"stopped by {signal.Signals(sig).name} at step ") == 1, stderr
        assert "Continue with: forge resume -p " in stderr and "Traceback" not in stderr, stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "checkpoints" / "checkpoint-000040").exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), *extra)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    return run_dir


@pytest.mark.parametrize(
    "sig",
    [
        # the default suite's SIGTERM is tests/reliability/test_preemption.py's (the process
        # group, loader workers running)
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, marks=pytest.mark.slow),  # the same path as SIGTERM
        signal.SIGKILL,
    ],
    ids=["sigterm", "sigint", "sigkill"],
)
def test_stop_and_resume_is_bit_identical(project, trained_once, sig):
    _, straight, _ = trained_once  # the same SMALL config, trained 40 steps straight
    resumed = stop_and_resume(project, sig)
    weights_a, optim_a = final_state(straight)
    weights_b, optim_b = final_state(resumed)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")


@pytest.mark.slow
def test_stop_and_resume_is_bit_identical_with_two_processes(project):
    straight = train_straight(project, "--nproc", "2")
    resumed = stop_and_resume(project, signal.SIGTERM, "--nproc", "2")
    weights_a, optim_a = final_state(straight)
    weights_b, optim_b = final_state(resumed)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")
    assert (resumed / "checkpoints" / "checkpoint-000040" / "rng-rank-00001.pt").exists()
