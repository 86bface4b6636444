"""The workers of a sweep as separate processes pick their trials (no training here: a trial's
run is created and claimed, as ``forge sweep`` does, and not trained): each draws its own point
from the study in Optuna's storage, and none takes another's trial number, which the sweep's
file lock guarantees; the race is made to happen, not hoped for."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from forge.sweep.runner import Sweeper
from forge.sweep.space import SweepSpec, parse_axis
from forge.sweep.study import Sweep, open_sweep
from tests.helpers import REPO

AXES = {"learning_rate": "loguniform(1e-4,1e-2)", "hidden_size": "int(8,256)"}


def spec(method: str = "tpe") -> SweepSpec:
    axes = [parse_axis(name, text) for name, text in AXES.items()]
    return SweepSpec(config="train", axes=axes, method=method, seed=3)


def make_run_in(output: Path):
    """``forge sweep``'s make_run without a config: a run directory and its record."""
    from forge.runs import create_run

    def make_run(values, field):
        return create_run(
            output / "train",
            config_name="train",
            config_text="{}\n",
            project_root=output.parent,
            overrides=[],
            variables=values,
            nproc=1,
            fields={"sweep": field},
        )

    return make_run


# one SLURM array task's worker: it picks its one trial, prints the trial's record and holds
# the trial's run (as its training would) until its input closes
TASK = """
import json, sys
from pathlib import Path
from tests.sweep.test_workers import Sweeper, make_run_in, open_sweep, spec
output = Path(sys.argv[1])
sweep = open_sweep(output, spec(), "study", trials=8)
job = Sweeper(sweep, output.parent, make_run_in(output), max_trials_here=1).next_job()
print(json.dumps(job.record), flush=True)
sys.stdin.read()
"""


def test_workers_each_draw_their_own_point_and_a_study_draws_them_again(tmp_path):
    """Three workers with a study object each (as three processes have), then one worker."""
    pytest.importorskip("optuna")
    output = tmp_path / "output"
    sweep = open_sweep(output, spec(), "study", trials=8)
    jobs = [Sweeper(sweep, tmp_path, make_run_in(output)).next_job() for _ in range(3)]
    assert [job.record["trial"] for job in jobs] == [0, 1, 2]
    points = [job.record["params"] for job in jobs]
    assert len({json.dumps(p, sort_keys=True) for p in points}) == 3, points
    again = open_sweep(tmp_path / "again", spec(), "study", trials=8)
    worker = Sweeper(again, tmp_path, make_run_in(tmp_path / "again"))
    jobs += [worker.next_job() for _ in range(3)]  # each holds its run, as in training
    assert [job.record["params"] for job in jobs[3:]] == points


@pytest.mark.slow
def test_array_tasks_each_draw_their_own_point_and_a_study_draws_them_again(tmp_path):
    pytest.importorskip("optuna")
    output = tmp_path / "output"
    tasks = [
        subprocess.Popen(
            [sys.executable, "-c", TASK, str(output)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    records = []
    try:
        for task in tasks:
            line = task.stdout.readline()  # its trial is picked: the next may pick
            assert line, task.communicate(timeout=60)[1]
            records.append(json.loads(line))
    finally:
        for task in tasks:
            task.communicate(timeout=60)
    assert sorted(r["trial"] for r in records) == [0, 1, 2]
    points = {r["trial"]: r["params"] for r in records}
    assert len({json.dumps(p, sort_keys=True) for p in points.values()}) == 3, points

    # the same study in one process, another sweep directory: the same points by number
    again = open_sweep(tmp_path / "again", spec(), "study", trials=8)
    worker = Sweeper(again, tmp_path, make_run_in(tmp_path / "again"))
    jobs = [worker.next_job() for _ in range(3)]  # each holds its run, as in training
    assert [job.record["trial"] for job in jobs] == [0, 1, 2]
    assert [job.record["params"] for job in jobs] == [points[n] for n in range(3)]


class PausedSweep(Sweep):
    """A sweep whose first reader stops between reading the trials and writing its own: it
    lets ``other`` start picking then, and goes on once ``other`` has read the trials or is
    waiting for the sweep's lock (seen in /proc/locks), whichever comes first."""

    other: Sweeper
    read = threading.Event()
    paused = False

    def records(self):
        found = super().records()
        if type(self).paused:
            type(self).read.set()  # the other worker read the trials
            return found
        type(self).paused = True
        thread = threading.Thread(target=lambda: setattr(self, "got", self.other.next_job()))
        thread.start()
        for _ in range(6000):  # a minute at most
            if type(self).read.wait(0.01) or _waiting_for(self.directory / ".lock"):
                break
        else:
            raise AssertionError("the second worker neither read the trials nor waited")
        self.thread = thread
        return found


def _waiting_for(path: Path) -> bool:
    """Whether a process waits for a lock on ``path`` (a blocked flock: '->' in /proc/locks)."""
    inode = path.stat().st_ino
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in line and f":{inode} " in line for line in lines)


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads Linux's /proc/locks")
def test_two_workers_in_the_race_window_take_two_trial_numbers(tmp_path):
    output = tmp_path / "output"
    first = open_sweep(output, spec("random"), "race", trials=4)
    paused = PausedSweep(first.directory, first.spec, first.name, first.trials)
    also = PausedSweep(first.directory, first.spec, first.name, first.trials)
    other = Sweeper(also, tmp_path, make_run_in(output))
    PausedSweep.other, PausedSweep.read, PausedSweep.paused = other, threading.Event(), False
    job = Sweeper(paused, tmp_path, make_run_in(output)).next_job()  # holds its run
    paused.thread.join(timeout=60)
    assert not paused.thread.is_alive(), "the second worker never got its trial"
    numbers = [job.record["trial"], paused.got.record["trial"]]
    assert sorted(numbers) == [0, 1]
    assert job.run_dir != paused.got.run_dir
    assert sorted(r["trial"] for r in first.records()) == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "fresh"])
def test_a_trial_process_is_a_process_of_its_own_with_its_exit_status(tmp_path, monkeypatch, fork):
    """Forked from the fork server or started fresh: its output in its log, its exit status as
    a process's (a worker outside a project: exit 2, the message logged)."""
    import os

    from forge.sweep.trial_process import TrialProcess

    monkeypatch.setenv("FORGE_SWEEP_FORK", fork)
    log = tmp_path / "sweep.log"
    argv = ["_worker", "-p", str(tmp_path), "--run-dir", str(tmp_path / "no_run")]
    child = TrialProcess(argv, dict(os.environ), log)
    assert child.wait() == 2
    assert "is not a forge project: no meta.yaml" in log.read_text()
