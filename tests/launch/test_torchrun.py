"""forge/launch/torchrun.py with real processes: a training process stops when the process that
started it dies (the kernel's parent-death signal on Linux, a watching thread elsewhere), and
torchrun's agent settles ``run.json`` when a rank dies without rank 0 saying why.

The whole job through ``forge train`` is tested in tests/reliability/test_job_lifetime.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forge.launch.torchrun import PARENT_ENV, record_launcher_death
from forge.runs import LAUNCH_LOCK, RunLock
from tests.helpers import REPO
from tests.reliability.procs import alive

# A process that asks to stop with its launcher, says so, then lives on long enough to be
# seen outliving a dead launcher: it leaves a file behind if it does.
CHILD = """
import os, signal, sys, time
from pathlib import Path
import forge.launch.torchrun as launch
if sys.argv[2] == "thread":  # the portable watch, as where there is no prctl
    launch._kernel_signals_parent_death = lambda signum: False
launch.stop_with_parent(signal.SIGKILL)
print(os.getpid(), os.environ.get(launch.PARENT_ENV), flush=True)
time.sleep(float(sys.argv[3]))
Path(sys.argv[1]).write_text("outlived its launcher")
"""

# The launcher: starts CHILD naming itself as the parent to stop with, then waits for ever.
LAUNCHER = """
import os, subprocess, sys
env = dict(os.environ, {name}=str(os.getpid()))
subprocess.Popen([sys.executable, "-c", {child!r}, *sys.argv[1:]], env=env).wait()
"""


def python(code: str, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, env=full_env, text=True, **kwargs
    )


def wait_until_gone(pid: int) -> None:
    while alive(pid):  # no time bound: a survivor leaves its file, which fails the test
        time.sleep(0.05)


@pytest.mark.parametrize("watch", ["kernel", "thread"])
def test_a_process_stops_when_its_launcher_is_killed(tmp_path, watch):
    survived = tmp_path / "survived"
    launcher = python(
        LAUNCHER.format(name=PARENT_ENV, child=CHILD),
        str(survived),
        watch,
        "30",
        stdout=subprocess.PIPE,
    )
    child_pid, named = launcher.stdout.readline().split()
    assert named == "None"  # consumed: what the child starts does not inherit it
    launcher.kill()
    launcher.wait()
    wait_until_gone(int(child_pid))
    assert not survived.exists()


def test_a_process_whose_launcher_died_before_it_asked_stops_at_once(tmp_path):
    gone = python("pass")
    gone.wait()  # a launcher that is already dead when the child asks
    child = python(
        CHILD, str(tmp_path / "survived"), "kernel", "30", env={PARENT_ENV: str(gone.pid)}
    )
    assert child.wait() == -signal.SIGKILL
    assert not (tmp_path / "survived").exists()


def test_a_process_no_forge_launcher_started_is_left_alone(tmp_path):
    """`accelerate launch` or a user's torchrun start forge's processes: nothing to watch."""
    survived = tmp_path / "survived"
    child = python(CHILD, str(survived), "kernel", "0", stdout=subprocess.PIPE)
    out, _ = child.communicate()
    assert child.returncode == 0 and out.split()[1] == "None"
    assert survived.read_text() == "outlived its launcher"


# A stand-in for forge's worker under torchrun: rank 1 is killed as the kernel's OOM killer
# would; rank 0 waits and is torn down by the agent, recording nothing.
WORKER = """
import os, signal, sys, time
from pathlib import Path
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
Path(sys.argv[1]).write_text("rank 0 was not stopped")
"""


def start_agent(run_dir: Path, tmp_path: Path, worker_text: str, argument: Path):
    """forge's torchrun agent for ``run_dir``, running ``worker_text`` as 2 ranks (stderr piped)."""
    worker = tmp_path / "worker.py"
    worker.write_text(worker_text)
    return python(
        "from forge.launch.torchrun import main; raise SystemExit(main())",
        f"--run-dir={run_dir}",
        f"--project={tmp_path}",
        "--nproc_per_node=2",
        "--standalone",
        str(worker),
        str(argument),
        stderr=subprocess.PIPE,
    )


def save_a_checkpoint(run_dir) -> None:
    """A small valid checkpoint in ``run_dir/checkpoints``, as a job that trained leaves."""
    from torch import nn

    from forge.checkpoint import (
        CheckpointRegistry,
        CheckpointWriter,
        Component,
        ModelWeights,
        Scope,
    )
    from forge.train.topology import Topology

    registry = CheckpointRegistry(Topology())
    registry.extend([Component("model", ModelWeights(nn.Linear(2, 2)), Scope.STAGE, weights=True)])
    with CheckpointWriter(run_dir / "checkpoints", 10) as writer:
        registry.save(writer)
        writer.set_meta(epoch=0, metrics={})


@pytest.mark.parametrize("saved", [False, True], ids=["never-saved", "saved"])
def test_a_rank_that_dies_marks_the_run_failed_naming_it(tmp_path, saved):
    """The message suggests `forge resume` only where there is a checkpoint to resume from."""
    run_dir = tmp_path / "run_001"
    run_dir.mkdir()
    if saved:
        save_a_checkpoint(run_dir)
    (run_dir / "run.json").write_text(json.dumps({"run": 1, "status": "running"}))
    agent = start_agent(run_dir, tmp_path, WORKER, tmp_path / "survived")
    _, stderr = agent.communicate()
    assert agent.returncode == 1, stderr
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed", record
    assert record["failure"]["rank"] == 1 and record["failure"]["exitcode"] == -signal.SIGKILL
    assert record["error"].startswith("rank 1 (pid ") and "was killed by SIGKILL" in record["error"]
    said = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, stderr
    assert said[0].startswith(f"error: {record['error']}; run_001 is marked failed; ")
    if saved:
        assert "`forge resume -p " in said[0] and "continues it from its newest" in said[0]
    else:
        assert said[0].endswith("it saved no checkpoint, so there is nothing to resume: train it "
                                "again with forge train")  # fmt: skip
        assert "forge resume" not in stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    assert not (tmp_path / "survived").exists()


def running_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run_001"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run": 1, "status": "running"}))
    return run_dir


def test_the_agent_waits_for_the_lock_of_a_launcher_whose_threads_are_still_exiting(
    tmp_path, capsys
):
    """SIGKILL to a launcher with several threads: the kernel sends the agent its parent-death
    signal as the launcher's first thread exits, but lets the launch lock go with its last.
    The agent waits for the lock its dead launcher signed, then marks the run killed."""
    run_dir = running_run(tmp_path)
    dying = RunLock.acquire(run_dir, LAUNCH_LOCK)  # signed with this pid: the launcher's
    letting_go = threading.Timer(0.5, dying.release)
    letting_go.start()
    record_launcher_death(run_dir, tmp_path, str(os.getpid()))
    letting_go.join()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "killed", record
    assert record["error"].startswith(
        f"the forge process that launched the job (pid {os.getpid()})"
    )
    assert capsys.readouterr().err.startswith("stopped run_001: the forge process that launched")


def test_the_agent_leaves_a_run_a_resume_has_claimed_to_it(tmp_path, capsys):
    run_dir = running_run(tmp_path)
    with RunLock.acquire(run_dir, LAUNCH_LOCK):  # signed with this pid: the resume's
        record_launcher_death(run_dir, tmp_path, "4194305")  # the dead launcher: another pid
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    assert capsys.readouterr().err == ""


# Rank 0 records the consequence first ("lost contact", as a rank whose peer vanished mid-step
# does); only then is rank 1 killed, as the kernel's OOM killer would.
WORKER_RANK_0_RECORDS_FIRST = """
import json, os, signal, sys, time
from pathlib import Path
record = Path(sys.argv[1]) / "run.json"
if os.environ["RANK"] == "0":
    data = {"run": 1, "status": "failed", "error": "lost contact with another process"}
    record.write_text(json.dumps(data))
    time.sleep(60)
while json.loads(record.read_text())["status"] != "failed":
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_by_a_signal_is_named_when_another_recorded_first(tmp_path):
    """A killed rank cannot say why itself: the agent names it, though the record already holds
    what its death did to rank 0 (which stays the record's error)."""
    run_dir = running_run(tmp_path)
    agent = start_agent(run_dir, tmp_path, WORKER_RANK_0_RECORDS_FIRST, run_dir)
    _, stderr = agent.communicate()
    assert agent.returncode == 1, stderr
    record = json.loads((run_dir / "run.json").read_text())
    assert record["error"] == "lost contact with another process"
    assert record["failure"]["rank"] == 1 and record["failure"]["exitcode"] == -signal.SIGKILL
    said = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, stderr
    assert said[0].startswith("error: rank 1 (pid ") and "was killed by SIGKILL" in said[0], said
