"""The Accelerate trainer through the real CLI: exact resume, and moving between trainers.

accel.yaml is tiny_lm's train.yaml with the trainer swapped, so the same SMALL settings apply.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import final_state, start_held
from tests.reliability.procs import alive, kill_tree
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration


def losses(run_dir: Path) -> dict[int, float]:
    """step -> logged training loss (the mean since the previous log)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def train(project: Path, config: str, *extra: str) -> Path:
    result = run_forge("train", config, "-p", str(project), *SMALL, *extra)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0])


def kill_job(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the whole job at once, as a lost machine would: the CLI, and torchrun with its
    workers found by descent from the forge process, never by name."""
    victims = kill_tree(proc.pid)  # found by descent from forge, before any of them dies
    proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in victims):
        assert time.monotonic() < deadline, "the job's processes did not die"
        time.sleep(0.2)


def kill_after_step_20_and_resume(project: Path, *extra: str) -> Path:
    proc, run_dir = start_held(
        "train", "accel.yaml", "-p", str(project), *SMALL, *extra, cwd=project, saved=20
    )
    kill_job(proc, run_dir)
    assert not (run_dir / "checkpoints" / "checkpoint-000040").exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), *extra)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    return run_dir


@pytest.mark.parametrize("nproc", ["1", "2"])
@pytest.mark.slow
def test_accel_sigkill_and_resume_is_bit_identical(project, nproc):
    extra = () if nproc == "1" else ("--nproc", "2")
    straight = train(project, "accel.yaml", *extra)
    manifest = json.loads(
        (straight / "checkpoints" / "checkpoint-000040" / "manifest.json").read_text()
    )
    assert manifest["trainer"] == "accelerate"
    assert manifest["topology"]["world_size"] == int(nproc)
    resumed = kill_after_step_20_and_resume(project, *extra)
    weights_a, optim_a = final_state(straight)
    weights_b, optim_b = final_state(resumed)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")
    assert losses(straight) == losses(resumed)  # the resumed log continues the same curve
    verify = run_forge("checkpoints", "-p", str(project), "--verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _continue(project: Path, config: str, checkpoint: Path, *extra: str) -> Path:
    return train(
        project, config, "--set", f"trainer.args.resume_from_checkpoint={checkpoint}", *extra
    )


def _assert_continues(source: dict[int, float], continued: dict[int, float]) -> None:
    assert min(continued) == 25  # it started at step 20, from the checkpoint
    # the loss goes on from where it was: the first window after the switch is near the last
    # one before it (the data order restarts the epoch on a new process count, so not equal)
    assert abs(continued[25] - source[25]) / source[25] < 0.1, (source, continued)
    # and it ends within a few percent of the run that never switched
    assert abs(continued[40] - source[40]) / source[40] < 0.05, (source, continued)


@pytest.mark.slow
def test_plain_checkpoint_continues_under_accelerate_with_two_processes(project, trained_once):
    _, plain_run, _ = trained_once  # train.yaml, one process, 40 steps
    checkpoint = plain_run / "checkpoints" / "checkpoint-000020"
    run_dir = _continue(project, "accel.yaml", checkpoint, "--nproc", "2")
    _assert_continues(losses(plain_run), losses(run_dir))
    manifest = json.loads(
        (run_dir / "checkpoints" / "checkpoint-000040" / "manifest.json").read_text()
    )
    assert (manifest["trainer"], manifest["topology"]["world_size"]) == ("accelerate", 2)


@pytest.mark.slow
def test_accelerate_checkpoint_continues_under_the_plain_trainer(project):
    accel_run = train(project, "accel.yaml", "--nproc", "2")
    checkpoint = accel_run / "checkpoints" / "checkpoint-000020"
    run_dir = _continue(project, "train.yaml", checkpoint)
    _assert_continues(losses(accel_run), losses(run_dir))


def test_generate_and_runs_work_for_accelerate_runs(trained_accel):
    project, run_dir = trained_accel
    runs = run_forge("runs", "-p", str(project))
    assert runs.returncode == 0 and "accel" in runs.stdout
    generated = run_forge("generate", str(run_dir), "--prompt", "import ", "--max-new-tokens", "8")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()


@pytest.fixture
def trained_accel(project):
    return project, train(project, "accel.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_accel_sigterm_exits_143_with_a_checkpoint(project, sig):
    proc, run_dir = start_held(
        "train", "accel.yaml", "-p", str(project), *SMALL, cwd=project, saved=10
    )
    proc.send_signal(sig)
    assert proc.wait(timeout=300) == 128 + sig
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_accelerate_launch_starts_the_job(project):
    """`accelerate launch` (here its torchrun-based multi-process launcher, which runs on CPU
    too) starting `forge train` on every process: rank 0 creates one run, both ranks train it."""
    import os
    import sys

    accelerate = Path(sys.executable).with_name("accelerate")
    command = [
        str(accelerate),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "forge.cli",
        "train",
        "accel.yaml",
        "-p",
        str(project),
        *SMALL,
        "-D",
        "max_steps=10",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted((project / "output" / "accel").iterdir())
    assert [r.name for r in runs] == ["run_001"]  # one run, not one per process
    run_dir = runs[0]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed"
    manifest = json.loads(
        (run_dir / "checkpoints" / "checkpoint-000010" / "manifest.json").read_text()
    )
    assert manifest["topology"]["world_size"] == 2
    assert "rank 0 of 2" in result.stderr
