"""A scheduler's stop never costs steps or exactness.

Schedulers stop a job by signalling every process of it (SLURM at its time limit or on
preemption, Kubernetes on eviction, ``kill -TERM -PGID``), not only forge's own process. For
every trainer, one and two processes, no and two data loader workers, the signal sent to
``forge`` alone, to its process group or to every process of the job, SIGTERM, SIGINT or the
scheduler's warning signal (SIGUSR1), at a random step: the job saves one checkpoint of the last
completed step, the run is ``interrupted``, forge exits 128 + the signal, and ``forge resume``
ends bit-identical to the run trained straight through. A loader worker never dies of the
stop signal before its rank has saved (the failure this guards: "DataLoader worker ... killed
by signal: Terminated", exit 1, the steps since the last save lost).

With ``--requeue`` under SLURM (a fake ``scontrol`` on PATH records its arguments) the job
requeues itself after the warning signal, and the requeued ``forge train`` continues the run.

Every job here is bounded (kill_harness.HANG_S, run_forge's timeout): a hang fails naming it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from forge.checkpoint import find_latest_checkpoint, parse_checkpoint_step
from tests.faults import pause_env
from tests.helpers import run_forge
from tests.integration.conftest import SMALL
from tests.reliability.kill_harness import HANG_S, Job
from tests.reliability.procs import alive, descendants, worker_pids
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration

MAX_STEPS = 40  # SMALL's: the straight runs end there
FIRST_EVAL_STEP = 20  # SMALL's eval_steps
# every step logs, so a signal can be aimed at a step (logging changes no weight)
LOG_EVERY_STEP = ("--set", "trainer.args.logging_steps=1")
TRAINERS = {
    "plain": ("train.yaml", ()),
    "accel": ("accel.yaml", ()),
    "pipeline": ("pipeline.yaml", ("-D", "num_layers=4")),  # 2 stages of 2 layers
    "fsdp": ("train.yaml", ("--set", "trainer.args.fsdp=full_shard")),
    # a moving average resumed from the checkpoint must continue the straight run's
    "ema": ("train.yaml", ("--set", "trainer.args.ema_decay=0.9")),
}


def workers_set(workers: int) -> tuple[str, ...]:
    return ("--set", f"trainer.args.dataloader_num_workers={workers}")


def send(job: Job, sig: int, target: str) -> None:
    """``cli``: forge alone; ``group``: its process group (``kill -TERM -PGID``; the job's
    own process in a session of its own, as on a terminal); ``every``: each process of the job,
    loader workers included (what SLURM does at a time limit)."""
    forge = job.proc.pid
    if target == "cli":
        os.kill(forge, sig)
    elif target == "group":
        os.killpg(forge, sig)
    else:
        for pid in [forge, *descendants(forge)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def stop_at_random_step(job: Job, sig: int, target: str, seed: int) -> tuple[int, list[int]]:
    """Signal the job once rank 0 has logged a random step; the step and the job's processes.
    Half the stops aim at the first evaluation's step, as its loader workers start (a worker
    the stop found still starting once died of it, failing its rank before the save)."""
    draw = random.Random(seed)
    aim = draw.choice([draw.randint(2, MAX_STEPS - 12), FIRST_EVAL_STEP])
    assert job.wait_for_line(rf"^step {aim}/{MAX_STEPS} "), job.text()
    processes = descendants(job.proc.pid)
    send(job, sig, target)
    return aim, processes


def wait_until_gone(job: Job, processes: list[int]) -> int:
    code = job.wait()  # a job that has not stopped after kill_harness.HANG_S fails as a hang
    assert not [pid for pid in processes if alive(pid)], job.text()  # no process outlived it
    return code


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        entry["step"]
        for entry in map(json.loads, lines)
        if "loss" in entry and "step" in entry and "eval_loss" not in entry
    ]


def assert_stopped_once(
    job: Job, code: int, run_dir: Path, sig: int, aim: int, *, own_launcher: bool = True
) -> int:
    """One checkpoint of the last completed step, status interrupted, exit 128 + sig, one
    message and no traceback; returns the step. Under a user's launcher (``own_launcher``
    False) the exit code and the launcher's own traceback are that launcher's."""
    name, text = signal.Signals(sig).name, job.text()
    assert code == 128 + sig or not own_launcher, text
    data = record(run_dir)
    assert data["status"] == "interrupted" and data["signal"] == name, f"{data}\n{text}"
    stopped = re.findall(rf"stopped by {name} at step (\d+); checkpoint (\S+) holds it", text)
    assert len(stopped) == 1, text
    step, checkpoint = int(stopped[0][0]), Path(stopped[0][1])
    assert step >= aim, text
    assert checkpoint == find_latest_checkpoint(run_dir / "checkpoints"), text
    assert parse_checkpoint_step(checkpoint) == step
    assert max(logged_steps(run_dir)) == step, text  # nothing trained past the checkpoint
    wrongs = ["killed by signal", "DataLoader worker"]
    if own_launcher:
        wrongs += ["Traceback", "SignalException"]
    for wrong in wrongs:
        assert wrong not in text, text
    return step


def resume_to_the_end(project: Path, run_dir: Path, step: int) -> None:
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {step}" in resumed.stderr, resumed.stderr
    assert record(run_dir)["status"] == "completed"


def end_state(run_dir: Path) -> dict[str, Any]:
    """The weights and optimizer state of a run's last checkpoint, file by file (one file, a
    pipeline's stages or FSDP's shards alike)."""
    checkpoint = run_dir / "checkpoints" / f"checkpoint-{MAX_STEPS:06d}"
    state: dict[str, Any] = {
        file.name: load_file(file) for file in sorted(checkpoint.glob("model*.safetensors"))
    }
    for file in sorted([*checkpoint.glob("optimizer*.pt"), *checkpoint.glob("ema*.pt")]):
        state[file.name] = torch.load(file, weights_only=True)
    assert any(name.startswith("optimizer") for name in state), sorted(state)
    return state


def assert_same_end(straight: Path, resumed: Path) -> None:
    a, b = end_state(straight), end_state(resumed)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    assert_same_tensors(a, b, "checkpoint")


def train_and_stop(
    project: Path, extra: tuple[str, ...], sig: int, target: str, workers: int, nproc: int = 1,
    env: dict[str, str] | None = None, launcher: list[str] | None = None,
) -> tuple[Job, Path, int, int]:  # fmt: skip
    """Start ``forge train``, signal it at a random step, wait for every process to end.
    ``launcher``: a user's (``torchrun --nproc_per_node=NPROC``) runs ``forge.cli train``."""
    # FORGE_TEST_SEED repeats a failed case's stop (pytest shows the seed with the failure)
    seed = int(os.environ.get("FORGE_TEST_SEED") or random.randrange(2**32))
    print(f"seed {seed}", file=sys.stderr)  # pytest shows it with a failure: the step it aimed at
    args = ["train", "-p", str(project), *SMALL, *extra, *LOG_EVERY_STEP, *workers_set(workers)]
    job = Job(args + ([] if launcher else ["--nproc", str(nproc)]), env=env, launcher=launcher)
    run_dir = Path(job.proc.stdout.readline().strip())
    aim, processes = stop_at_random_step(job, sig, target, seed)
    if workers:  # the loader workers were there to be hit: ranks' children (forge's with one)
        ranks = nproc if nproc > 1 or launcher else 0
        agent = 1 * (nproc > 1 and not launcher)  # forge's torchrun (a launcher's is job.proc)
        assert len(processes) >= ranks + agent + nproc * workers, job.text()
    code = wait_until_gone(job, processes)
    return job, run_dir, code, aim


def test_sigterm_to_the_process_group_with_loader_workers_resumes_bit_identical(
    project, trained_once
):
    """The default suite's one: one process and two loader workers in forge's process group,
    SIGTERM to the group (``kill -TERM -PGID``) at a random step."""
    _, straight, _ = trained_once  # SMALL, 40 steps straight (loader workers change no batch)
    job, run_dir, code, aim = train_and_stop(project, (), signal.SIGTERM, "group", workers=2)
    step = assert_stopped_once(job, code, run_dir, signal.SIGTERM, aim)
    resume_to_the_end(project, run_dir, step)
    assert_same_end(straight, run_dir)


# ------------------------------------------------------------------ the matrix (slow)

_STRAIGHT: dict[tuple[str, int], Path] = {}


@pytest.fixture
def straight_run(warm_project, tmp_path_factory):
    """The run trained straight through, per trainer and process count (trained once)."""

    def make(trainer: str, nproc: int) -> Path:
        if (trainer, nproc) not in _STRAIGHT:
            config, extra = TRAINERS[trainer]
            dest = tmp_path_factory.mktemp(f"straight-{trainer}-{nproc}") / "tiny_lm"
            shutil.copytree(warm_project, dest)
            result = run_forge(
                "train", config, "-p", str(dest), *SMALL, *extra, "--nproc", str(nproc)
            )
            assert result.returncode == 0, result.stderr
            _STRAIGHT[(trainer, nproc)] = Path(result.stdout.splitlines()[0])
        return _STRAIGHT[(trainer, nproc)]

    return make


MATRIX = [
    pytest.param(nproc, workers, target, sig, id=f"{nproc}proc-{workers}workers-{target}-{name}")
    for nproc in (1, 2)
    for workers in (0, 2)
    for target in ("cli", "group")
    for sig, name in ((signal.SIGTERM, "sigterm"), (signal.SIGINT, "sigint"))
]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,workers,target,sig", MATRIX)
def test_a_stop_saves_the_last_step_and_resumes_bit_identical(
    project, straight_run, nproc, workers, target, sig
):
    job, run_dir, code, aim = train_and_stop(project, (), sig, target, workers, nproc)
    step = assert_stopped_once(job, code, run_dir, sig, aim)
    resume_to_the_end(project, run_dir, step)
    assert_same_end(straight_run("plain", nproc), run_dir)


OTHERS = [
    pytest.param("accel", "every", signal.SIGTERM, id="accel-every-sigterm"),
    pytest.param("pipeline", "cli", signal.SIGTERM, id="pipeline-cli-sigterm"),
    pytest.param("fsdp", "group", signal.SIGINT, id="fsdp-group-sigint"),
    pytest.param("plain", "every", signal.SIGUSR1, id="plain-every-sigusr1"),
    pytest.param("ema", "group", signal.SIGTERM, id="ema-group-sigterm"),
]


@pytest.mark.slow
@pytest.mark.parametrize("trainer,target,sig", OTHERS)
def test_every_trainer_with_two_processes_and_loader_workers_stops_exactly(
    project, straight_run, trainer, target, sig
):
    """``every``: each process of the job gets the signal (SLURM's way), so each rank gets it
    twice (directly and from torchrun's agent): still one save, one message."""
    config, extra = TRAINERS[trainer]
    job, run_dir, code, aim = train_and_stop(project, (config, *extra), sig, target, 2, nproc=2)
    step = assert_stopped_once(job, code, run_dir, sig, aim)
    assert job.text().count(f"received {signal.Signals(sig).name}") == 1, job.text()
    resume_to_the_end(project, run_dir, step)
    assert_same_end(straight_run(trainer, 2), run_dir)


LAUNCHERS = {  # a user's launcher of 2 processes, the config it trains, its straight run's
    "torchrun": (["torchrun", "--nproc_per_node=2"], "train.yaml", "plain"),
    "accelerate": (
        ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        + ["--mixed_precision", "no", "--dynamo_backend", "no"],
        "accel.yaml",
        "accel",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_job_a_users_launcher_started_stops_and_resumes_under_it_bit_identical(
    project, straight_run, launcher
):
    """`torchrun` / `accelerate launch` running `forge.cli train` on 2 processes with 2 loader
    workers each, SIGTERM to the launcher's whole process group at a random step (a scheduler's
    stop): rank 0 saves the last step once, the run is interrupted, and the same launcher
    running `forge.cli resume` ends bit-identical to `forge train --nproc 2`'s straight run."""
    prefix, config, trainer = LAUNCHERS[launcher]
    command = [str(Path(sys.executable).with_name(prefix[0])), *prefix[1:]]
    job, run_dir, code, aim = train_and_stop(
        project, (config,), signal.SIGTERM, "group", 2, nproc=2, launcher=command
    )
    step = assert_stopped_once(job, code, run_dir, signal.SIGTERM, aim, own_launcher=False)
    resumed = Job(["resume", "-p", str(project), "--run-dir", str(run_dir)], launcher=command)
    assert resumed.wait() == 0, resumed.text()
    assert resumed.text().count(f"resumed from {run_dir}") == 1, resumed.text()
    assert f"at step {step}" in resumed.text(), resumed.text()
    assert record(run_dir)["status"] == "completed"
    assert_same_end(straight_run(trainer, 2), run_dir)


# ------------------------------------------------------------------ SLURM's warning, requeue


def fake_scontrol(directory: Path) -> Path:
    """An ``scontrol`` that records its arguments (one line per call) and succeeds."""
    calls = directory / "scontrol-calls"
    script = directory / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return calls


@pytest.mark.slow
def test_slurms_warning_signal_saves_requeues_and_the_requeued_job_continues(
    project, trained_once, tmp_path
):
    _, straight, _ = trained_once
    calls = fake_scontrol(tmp_path)
    slurm = {"SLURM_JOB_ID": "4242", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    job, run_dir, code, aim = train_and_stop(
        project, ("--requeue",), signal.SIGUSR1, "group", workers=2, env=slurm
    )
    step = assert_stopped_once(job, code, run_dir, signal.SIGUSR1, aim)
    assert calls.read_text() == "requeue 4242\n"
    assert [r["job"] for r in record(run_dir)["requeues"]] == ["4242"]
    assert "requeued SLURM job 4242 (stopped by SIGUSR1)" in job.text()

    # SLURM runs the batch script again: the same command, SLURM_RESTART_COUNT=1
    again = run_forge(
        "train", "-p", str(project), *SMALL, *LOG_EVERY_STEP, *workers_set(2), "--requeue",
        env={**slurm, "SLURM_RESTART_COUNT": "1"},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[0] == str(run_dir), again.stdout
    assert f"at step {step}" in again.stderr, again.stderr
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]  # no new run
    assert record(run_dir)["status"] == "completed"
    assert calls.read_text() == "requeue 4242\n"  # a completed job is not requeued
    assert_same_end(straight, run_dir)


# ------------------------------------------------------------------ a node that waits


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_while_node_0_waits_for_node_1_exits_quietly_and_leaves_no_run(project, sig):
    from tests.integration.test_multinode import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    job = Job(
        ["train", "-p", str(project), *SMALL, "--nnodes", "2", "--node-rank", "0"]
        + ["--rdzv-endpoint", endpoint]
    )
    assert job.wait_for_line(r"waiting for node 1 to join"), job.text()
    processes = descendants(job.proc.pid)
    os.killpg(job.proc.pid, sig)  # Ctrl-C in the terminal: forge's process group
    code = wait_until_gone(job, processes)
    assert code == 128 + sig, job.text()
    assert "Traceback" not in job.text() and "KeyboardInterrupt" not in job.text(), job.text()
    assert not list((project / "output" / "train").glob("run_*")), job.text()


# ------------------------------------------------------------------ a stop before the loop


def catches_stops(pid: int) -> bool:
    """Whether ``pid`` handles SIGTERM (its SigCgt mask): the Python interpreter has started
    and runs forge's code; before that no program can answer a signal."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def wait_for_file(path: Path, job: Job) -> None:
    """Until ``path`` exists; a job that ends first, or a hang, fails the test naming it."""
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        assert job.proc.poll() is None, f"the job ended before {path.name}:\n{job.text()}"
        assert time.monotonic() < deadline, f"no {path.name} in {HANG_S} s:\n{job.text()}"
        time.sleep(0.05)


def wait_for_ranks(job: Job, nproc: int) -> dict[int, int]:
    """The job's training processes by rank, once all ``nproc`` run forge's code."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline and job.proc.poll() is None:
        ranks = worker_pids(job.proc.pid)
        if len(ranks) == nproc and all(map(catches_stops, ranks.values())):
            return ranks
        time.sleep(0.05)
    raise AssertionError(f"the job's {nproc} ranks never started:\n{job.text()}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,sig,target",
    [
        (1, signal.SIGUSR1, "cli"),
        (1, signal.SIGTERM, "group"),
        (2, signal.SIGUSR1, "every"),
        (2, signal.SIGTERM, "ranks"),
    ],
    ids=["1proc-sigusr1-cli", "1proc-sigterm-group", "2proc-sigusr1-every", "2proc-sigterm-ranks"],
)
def test_a_stop_before_the_loop_starts_ends_the_job_cleanly(project, tmp_path, nproc, sig, target):
    """A stop while the job starts (the model and the data being built): nothing to save, so
    the job ends at once, exit 128 + N, without a traceback, and leaves no run behind (it never
    trained). ``ranks``: the signal reaches only the training processes (not the agent). One
    process: the stop comes at the last moment before the loop, where the process waits for it
    (tests.faults.pause_env); a signal sent once the run directory is printed may otherwise
    find, on a busy machine, a loop that has trained a step already."""
    marker = tmp_path / "before-the-loop"
    env = pause_env(marker) if nproc == 1 else None
    job = Job(["train", "-p", str(project), *SMALL, "--nproc", str(nproc)], env)
    run_dir = Path(job.proc.stdout.readline().strip())
    assert run_dir.is_dir(), job.text()
    if nproc == 1:
        wait_for_file(marker, job)
        send(job, sig, target)
    else:
        ranks = wait_for_ranks(job, nproc)  # each rank is importing or building its model
        if target == "ranks":
            for pid in ranks.values():
                os.kill(pid, sig)
        else:
            send(job, sig, target)
    code = wait_until_gone(job, descendants(job.proc.pid))
    text = job.text()
    assert code == 128 + sig, text
    for wrong in ("Traceback", "killed by signal", "SignalException", "error:"):
        assert wrong not in text, text
    assert not run_dir.exists(), text  # removed: it never trained a step
    assert "step 1/" not in text, text


# ------------------------------------------------------------------ ranks stopped, restarts on


@pytest.mark.slow
def test_ranks_stopped_on_a_signal_after_saving_are_not_restarted(project):
    """``--max-restarts``: torchrun restarts ranks that fail. Ranks that a scheduler stopped
    (SIGTERM to the training processes only, not to the agent) saved and exited 143: the job
    stops there, interrupted, exit 143, and is not restarted."""
    job = Job(
        ["train", "-p", str(project), *SMALL, *LOG_EVERY_STEP, "--nproc", "2"]
        + ["--max-restarts", "1"]
    )
    run_dir = Path(job.proc.stdout.readline().strip())
    aim = random.randrange(2, MAX_STEPS - 12)
    assert job.wait_for_line(rf"^step {aim}/{MAX_STEPS} "), job.text()
    processes = descendants(job.proc.pid)
    for pid in worker_pids(job.proc.pid).values():
        os.kill(pid, signal.SIGTERM)
    code = wait_until_gone(job, processes)
    step = assert_stopped_once(job, code, run_dir, signal.SIGTERM, aim)
    assert "restarting the workers" not in job.text(), job.text()
    assert not record(run_dir).get("restarts"), record(run_dir)
    resume_to_the_end(project, run_dir, step)
