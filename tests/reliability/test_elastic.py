"""`forge train --max-restarts N`: a worker that dies is started again by torchrun's elastic
agent and the job continues from the run's newest checkpoint, with no user command, to the
same weights as a run that never failed."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from forge.checkpoint import parse_checkpoint_step
from tests.helpers import REPO
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import final_state, start_forge, train_straight, wait_for
from tests.reliability.procs import worker_pids
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration


def wait_for_workers(proc, nproc: int) -> dict[int, int]:
    workers: dict[int, int] = {}
    while len(workers) < nproc:
        assert proc.poll() is None, proc.stderr.read()
        workers = worker_pids(proc.pid)
    return workers


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_killed_worker_is_restarted_from_the_newest_checkpoint(project, trained_once, nproc):
    if nproc == 1:
        straight = trained_once[1]  # the same SMALL config, one process, never interrupted
    else:
        straight = train_straight(project, "--nproc", "2")
    args = ["-p", str(project), *SMALL, "--nproc", str(nproc), "--max-restarts", "2"]
    train = start_forge("train", *args, cwd=REPO)
    run_dir = Path(train.stdout.readline().strip())
    victim = wait_for_workers(train, nproc)[nproc - 1]  # the last rank
    wait_for(run_dir / "checkpoints" / "checkpoint-000020", train)
    os.kill(victim, signal.SIGKILL)
    _, stderr = train.communicate(timeout=600)
    assert train.returncode == 0, stderr

    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["step"] == 40
    assert [r["restart"] for r in record["restarts"]] == [1], record["restarts"]
    restarted_from = record["restarts"][0]["from"]
    assert parse_checkpoint_step(restarted_from) >= 20
    assert Path(restarted_from).parent == run_dir / "checkpoints"  # the run's own checkpoint
    step = parse_checkpoint_step(restarted_from)
    assert f"resumed from {restarted_from} at step {step}" in stderr
    died = f"rank {nproc - 1} (pid {victim}) was killed by SIGKILL"
    assert f"warning: {died}; restarting the workers (restart 1 of 2, --max-restarts)" in stderr
    assert "restart 1 of the workers (--max-restarts): continuing from " in stderr
    assert record["restarts"][0]["after"] == died
    assert record["resumes"] == []  # no user command was needed

    weights_a, optim_a = final_state(straight)
    weights_b, optim_b = final_state(run_dir)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")


def test_max_restarts_must_not_be_negative(project):
    from tests.helpers import run_forge

    result = run_forge("train", "-p", str(project), *SMALL, "--max-restarts", "-1")
    assert result.returncode == 2
    assert "--max-restarts must be 0 or a positive integer (got -1)" in result.stderr
    assert not (project / "output" / "train").exists()
