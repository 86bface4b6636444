"""A `forge train --nproc 2` job lives and dies with its `forge` process, for every trainer.

torchrun and each worker run in a session of their own, so SIGKILL to the forge process, or to
its process group (what `kill -9 -PGID` and schedulers do), reaches none of them:
forge/launch/torchrun.py has them stop when their parent dies. They must train no further,
`run.json` must say what happened, and `forge resume` right after must continue the run from
its newest checkpoint.
SIGTERM and Ctrl-C still save first and end with one message; a rank or a torchrun that dies
marks the run failed, naming it.

The job's processes are found by descent from the forge pid, taken before the kill.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from forge.checkpoint import find_latest_checkpoint, parse_checkpoint_step
from tests.helpers import run_forge
from tests.integration.conftest import SMALL
from tests.reliability.kill_harness import Job
from tests.reliability.procs import alive, descendants, worker_pids

pytestmark = pytest.mark.integration

SAVE_STEPS = 5
MAX_STEPS = 200  # far beyond the kill: workers that outlived forge would train on and save
TRAINERS = {
    "train.yaml": SMALL,
    "accel.yaml": SMALL,
    "pipeline.yaml": [*SMALL, "-D", "num_layers=4"],  # 2 stages of 2 layers
}
_SAVED = r"saved checkpoint .*checkpoint-(\d+)$"


def start(project: Path, config: str) -> tuple[Job, Path, list[int]]:
    """A two-process job of ``config``, once it has saved a checkpoint; its processes."""
    job = Job(
        ["train", config, "-p", str(project), *TRAINERS[config], "--nproc", "2"]
        + ["-D", f"max_steps={MAX_STEPS}", "-D", f"save_steps={SAVE_STEPS}"]
    )  # a session of its own: its process group is forge alone
    run_dir = Path(job.proc.stdout.readline().strip())
    assert job.wait_for_line(_SAVED), job.text()
    assert sorted(worker_pids(job.proc.pid)) == [0, 1], job.text()
    return job, run_dir, descendants(job.proc.pid)  # torchrun and the two workers


def wait_until_gone(job: Job, processes: list[int]) -> None:
    """Wait for every process of the job to end (no time bound: one that trains on saves
    checkpoints, and the assertions after this fail)."""
    job.proc.wait()
    while any(alive(pid) for pid in processes):
        time.sleep(0.05)
    job._reader.join()  # every writer of its stderr is gone


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def resume_continues(project: Path, run_dir: Path) -> None:
    """`forge resume` right away continues from the newest checkpoint, two steps further."""
    newest = find_latest_checkpoint(run_dir / "checkpoints")
    step = parse_checkpoint_step(newest)
    longer = f"trainer.args.max_steps={step + 2}"
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), "--set", longer)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {newest} at step {step}" in resumed.stderr
    assert record(run_dir)["status"] == "completed" and record(run_dir)["step"] == step + 2


KILLS = [
    pytest.param("train.yaml", "group", id="plain-group"),
    pytest.param("train.yaml", "forge", id="plain-forge", marks=pytest.mark.slow),
    pytest.param("accel.yaml", "group", id="accel-group", marks=pytest.mark.slow),
    pytest.param("accel.yaml", "forge", id="accel-forge", marks=pytest.mark.slow),
    pytest.param("pipeline.yaml", "group", id="pipeline-group", marks=pytest.mark.slow),
    pytest.param("pipeline.yaml", "forge", id="pipeline-forge", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("config,target", KILLS)
def test_a_sigkilled_forge_takes_its_job_with_it(project, config, target):
    job, run_dir, processes = start(project, config)
    forge = job.proc.pid
    if target == "group":
        os.killpg(forge, signal.SIGKILL)  # kill -9 -PGID
    else:
        os.kill(forge, signal.SIGKILL)
    wait_until_gone(job, processes)

    newest = find_latest_checkpoint(run_dir / "checkpoints")
    assert parse_checkpoint_step(newest) < MAX_STEPS // 2, job.text()  # nothing trained on
    data = record(run_dir)
    assert data["status"] == "killed", data
    assert data["error"].startswith(f"the forge process that launched the job (pid {forge}) died")
    assert f"stopped {run_dir.name}: the forge process that launched the job" in job.text()
    assert "Traceback" not in job.text()
    listed = run_forge("runs", "-p", str(project))
    assert "killed" in listed.stdout.splitlines()[1], listed.stdout
    resume_continues(project, run_dir)


STOPS = [
    pytest.param("accel.yaml", signal.SIGTERM, id="accel-sigterm"),
    pytest.param("pipeline.yaml", signal.SIGTERM, id="pipeline-sigterm"),
    pytest.param("train.yaml", signal.SIGINT, id="plain-ctrl-c"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config,sig", STOPS)
def test_a_signal_to_the_process_group_saves_once_and_says_so_once(project, config, sig):
    """SIGTERM from a scheduler, or Ctrl-C in a terminal (SIGINT to the foreground process
    group): forge passes it on once; every rank stops at one step, saves, exits 128+N."""
    job, run_dir, processes = start(project, config)
    os.killpg(job.proc.pid, sig)
    wait_until_gone(job, processes)
    name = signal.Signals(sig).name
    assert job.proc.returncode == 128 + sig, job.text()
    data = record(run_dir)
    assert data["status"] == "interrupted" and data["signal"] == name, data
    text = job.text()
    assert text.count(f"received {name}") == 1, text  # rank 0 says so; nobody got it twice
    stopped = re.findall(rf"stopped by {name} at step (\d+); checkpoint (\S+) holds it", text)
    assert len(stopped) == 1, text
    step, checkpoint = stopped[0]
    assert Path(checkpoint) == find_latest_checkpoint(run_dir / "checkpoints")
    assert parse_checkpoint_step(Path(checkpoint)) == int(step)
    assert f"Continue with: forge resume -p {project} --run-dir {run_dir}" in text
    assert "Traceback" not in text and "SignalException" not in text


@pytest.mark.slow
def test_a_killed_rank_marks_the_run_failed_naming_it(project):
    job, run_dir, processes = start(project, "train.yaml")
    victim = worker_pids(job.proc.pid)[1]
    os.kill(victim, signal.SIGKILL)  # as the kernel's OOM killer would
    wait_until_gone(job, processes)
    assert job.proc.returncode == 1, job.text()
    data = record(run_dir)
    assert data["status"] == "failed", data
    assert data["failure"] == {"rank": 1, "pid": victim, "exitcode": -signal.SIGKILL}
    said = f"error: rank 1 (pid {victim}) was killed by SIGKILL; run_001 is marked failed"
    assert job.text().count(said) == 1, job.text()
    assert "Traceback" not in job.text()
    listed = run_forge("runs", "-p", str(project))
    assert "failed" in listed.stdout.splitlines()[1], listed.stdout
    resume_continues(project, run_dir)


@pytest.mark.slow
def test_a_killed_torchrun_takes_its_workers_with_it_and_forge_records_it(project):
    job, run_dir, processes = start(project, "train.yaml")
    torchrun = processes[0]  # forge's one child (parents come first)
    assert torchrun not in worker_pids(job.proc.pid).values()
    os.kill(torchrun, signal.SIGKILL)
    wait_until_gone(job, processes)
    assert job.proc.returncode == 1, job.text()
    assert parse_checkpoint_step(find_latest_checkpoint(run_dir / "checkpoints")) < MAX_STEPS // 2
    data = record(run_dir)
    assert data["status"] == "failed", data
    assert data["error"] == f"torchrun (pid {torchrun}) was killed by SIGKILL"
    assert f"error: torchrun (pid {torchrun}) was killed by SIGKILL; run_001 is marked failed" in (
        job.text()
    )
    resume_continues(project, run_dir)
