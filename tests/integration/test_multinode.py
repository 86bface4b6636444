"""Two nodes simulated on this machine: two `forge train --nnodes 2 --node-rank 0|1
--rdzv-endpoint 127.0.0.1:PORT` commands, one process each, meeting at torchrun's c10d
rendezvous as two machines would.

They train one job into one run directory (node 0 creates it, node 1 learns it), write one
checkpoint per save, and `forge resume` on both continues it bit-identically to a straight
two-process run. Killing one node's forge the way a scheduler does (SIGKILL to its process
group) stops the other node's processes with a message, never a hang. A node that cannot see
the run directory (a private mount here, an unshared filesystem on a cluster) stops the job
on every node with one message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import final_state, train_straight
from tests.reliability.kill_harness import Job
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration  # the torchrun command lines: tests/launch/test_cluster.py

MAX_STEPS = 120  # far beyond the kill: processes that trained on would save further
SETTINGS = [*SMALL, "-D", f"max_steps={MAX_STEPS}", "-D", "save_steps=10"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def nodes(command: str, project: Path, *extra: str, node1_prefix: list[str] = ()) -> list[Job]:
    """``forge COMMAND`` started as node 0 and node 1 of one job (each a session of its own,
    so that its process group is its forge alone, as on two machines); ``node1_prefix``
    changes what node 1 sees."""
    endpoint = f"127.0.0.1:{free_port()}"
    jobs = []
    for rank in (0, 1):
        args = [command, "-p", str(project), *extra, "--nnodes", "2", "--node-rank", str(rank)]
        args += ["--rdzv-endpoint", endpoint]
        prefix = list(node1_prefix) if rank else []
        jobs.append(start([*prefix, sys.executable, "-m", "forge.cli", *args]))
    return jobs


_STARTED: list[Job] = []  # every node this module started, stopped if a test left it running


@pytest.fixture(autouse=True)
def _stop_leftover_nodes():
    yield
    while _STARTED:
        job = _STARTED.pop()
        if job.proc.poll() is None:  # a failed test's node: its whole session goes
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()


def start(command: list[str], env: dict[str, str] | None = None) -> Job:
    """A Job (stderr read as it comes) running ``command``."""
    job = Job.__new__(Job)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **(env or {}))
    job.lines = []
    job.changed = threading.Condition()
    job.proc = subprocess.Popen(
        command, cwd=REPO, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    job._reader = threading.Thread(target=job._read, daemon=True)
    job._reader.start()
    _STARTED.append(job)
    return job


def finish(jobs: list[Job]) -> list[int]:
    """Wait for every node's forge (no time bound: a hang fails the run, not a timer)."""
    codes = [job.proc.wait() for job in jobs]
    for job in jobs:
        job._reader.join()
    return codes


def said(job: Job, pattern: str, safety_s: float = 60) -> re.Match:
    """The first stderr line matching ``pattern``; ``safety_s`` only keeps a broken test from
    hanging (the message itself comes within seconds of the wait it describes)."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + safety_s
    with job.changed:
        while True:
            for line in job.lines:
                if regex.search(line):
                    return regex.search(line)
            alive = job._reader.is_alive()
            assert alive and time.monotonic() < deadline, f"no {pattern!r} in:\n{job.text()}"
            job.changed.wait(timeout=0.5)


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*"))


def wait_for_checkpoint(project: Path, jobs: list[Job], name: str) -> Path:
    """The job's run directory once its checkpoint ``name`` is committed."""
    while True:
        runs = sorted((project / "output" / "train").glob("run_*"))
        if runs and (runs[-1] / "checkpoints" / name / "manifest.json").exists():
            return runs[-1]
        assert all(job.proc.poll() is None for job in jobs), [j.text() for j in jobs]
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["node1-killed", "node0-killed"])
def test_two_nodes_train_one_run_survive_a_dead_node_and_resume_exactly(project, victim):
    jobs = nodes("train", project, *SETTINGS)
    run_dir = wait_for_checkpoint(project, jobs, "checkpoint-000010")
    os.killpg(jobs[victim].proc.pid, signal.SIGKILL)  # as a scheduler ends a node's job
    codes = finish(jobs)
    survivor = jobs[1 - victim]
    text = survivor.text()
    assert codes[victim] == -signal.SIGKILL
    assert codes[1 - victim] == 1, text
    assert "error: " in text and "Traceback" not in text, text
    assert len(list((project / "output" / "train").glob("run_*"))) == 1  # one run, node 0's
    saved = checkpoints(run_dir)
    assert saved and saved[-1] < f"checkpoint-{MAX_STEPS // 2:06d}", saved  # nothing trained on
    data = record(run_dir)
    assert data["status"] in ("failed", "killed"), data
    assert data["world_size"] == 2

    resumed = nodes("resume", project, "--run-dir", str(run_dir))
    codes = finish(resumed)
    assert codes == [0, 0], [job.text() for job in resumed]
    assert resumed[1].proc.stdout.read().split() == [str(run_dir)]  # node 1 learnt the run
    assert record(run_dir)["status"] == "completed"
    saves = [f"checkpoint-{step:06d}" for step in range(10, MAX_STEPS + 1, 10)]
    assert set(checkpoints(run_dir)) <= set(saves)  # one checkpoint per save, no stray copy
    assert f"checkpoint-{MAX_STEPS:06d}" in checkpoints(run_dir)

    straight = train_straight(project, *SETTINGS[len(SMALL) :], "--nproc", "2")
    weights_a, optim_a = final_state(straight, MAX_STEPS)
    weights_b, optim_b = final_state(run_dir, MAX_STEPS)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs a private mount namespace (unshare -m)")
def test_a_node_that_cannot_see_the_run_stops_the_job_with_one_message(project):
    """Node 1 runs with the project's output hidden under an empty mount, as a node without
    the shared filesystem would: every node stops (exit 2), nobody trains or waits."""
    hidden = project / "output" / "train"
    hidden.mkdir(parents=True, exist_ok=True)
    mount = f'mount -t tmpfs none {hidden} && exec "$0" "$@"'
    jobs = nodes("train", project, *SMALL, node1_prefix=["unshare", "-m", "sh", "-c", mount])
    codes = finish(jobs)
    text = jobs[0].text() + jobs[1].text()
    assert codes == [2, 2], text
    said = "cannot see the run directory"
    assert text.count(said) == 1, text  # once, by the job's rank 0
    assert "mounts at the same path" in text and "Traceback" not in text
    assert not list(hidden.glob("run_*"))  # node 0 removed the run that never started


def slurm_port() -> int:
    """A free port in the range forge derives from SLURM_JOB_ID (forge/launch/cluster.py)."""
    for port in range(29500 + os.getpid() % 1000, 31500):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 29500-31499")


@pytest.mark.slow
def test_srun_on_two_nodes_trains_one_run(project):
    """What `srun --nodes 2 --ntasks-per-node=1 forge train ...` gives each task (a faked
    SLURM step on this machine): no node flags, SLURM's variables name the job."""
    port = slurm_port()
    slurm = {
        "SLURM_JOB_ID": str(port - 29500),  # forge's port: 29500 + job id % 2000
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "127.0.0.1",
    }
    command = [sys.executable, "-m", "forge.cli", "train", "-p", str(project), *SMALL]
    command += ["-D", "max_steps=10", "-D", "save_steps=5"]
    jobs = [
        start(command, {**slurm, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)})
        for node in (0, 1)
    ]
    codes = finish(jobs)
    assert codes == [0, 0], [job.text() for job in jobs]
    (run_dir,) = (project / "output" / "train").glob("run_*")
    assert [job.proc.stdout.read().split() for job in jobs] == [[str(run_dir)]] * 2
    assert f"node 1 of 2 (rendezvous 127.0.0.1:{port}, id slurm-{port - 29500}, from SLURM)" in (
        jobs[1].text()
    )
    data = record(run_dir)
    assert (data["status"], data["world_size"], data["step"]) == ("completed", 2, 10)
    assert checkpoints(run_dir) == ["checkpoint-000005", "checkpoint-000010"]


def test_srun_with_two_tasks_on_one_node_is_refused_on_both(project):
    """`srun -N1 -n2 forge train ...`: each task would train a run of its own; both refuse
    with the fix (exit 2) and neither creates a run."""
    slurm = {
        "SLURM_JOB_ID": "4712",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODEID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "127.0.0.1",
    }
    command = [sys.executable, "-m", "forge.cli", "train", "-p", str(project), *SMALL]
    jobs = [
        start(command, {**slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)})
        for task in (0, 1)
    ]
    codes = finish(jobs)
    texts = [job.text() for job in jobs]
    assert codes == [2, 2], texts
    for text in texts:
        assert "srun started 2 tasks on 1 node" in text and "--ntasks-per-node=1" in text, text
    assert not (project / "output" / "train").exists()


def node(rank: int, endpoint: str, project: Path, *extra: str, env=None) -> Job:
    """``forge train`` as node ``rank`` of a job of two at ``endpoint``."""
    args = ["-m", "forge.cli", "train", "-p", str(project), *SMALL, *extra, "--nnodes", "2"]
    args += ["--node-rank", str(rank), "--rdzv-endpoint", endpoint]
    return start([sys.executable, *args], env)


def errors(job: Job) -> list[str]:
    return [line for line in job.lines if line.startswith("error: ")]


@pytest.mark.slow
def test_a_node_alone_says_whom_it_waits_for_and_another_config_is_refused_on_both(project):
    """Node 1 asked for `pipeline`, node 0 for `train`: node 1 says at once that it waits for
    node 0 (where, as which node, how long); when node 0 comes, both stop (exit 2) with one
    message naming the keys that differ, and node 0 removes the run that never started."""
    endpoint = f"127.0.0.1:{free_port()}"
    one = node(1, endpoint, project, "pipeline")
    said(one, rf"^node 1 of 2: waiting for node 0 at {endpoint}, where nobody answers yet .*"
              r"\(waiting up to 600 s\)$")  # fmt: skip
    zero = node(0, endpoint, project)
    codes = finish([zero, one])
    assert codes == [2, 2], [zero.text(), one.text()]
    for job in (zero, one):
        (message,) = errors(job)
        assert message.startswith(
            "error: node 1 rendered another config than node 0 (node 0: train.yaml, node 1: "
            "pipeline.yaml), which would train node 0's: they differ at meta.config (node 0: "
            "'train', node 1: 'pipeline');"
        ), message
        assert "start forge on every node with the same command, CONFIG, -D and --set" in message
        assert "Traceback" not in job.text()
    assert errors(zero) == errors(one)
    assert not list((project / "output" / "train").glob("run_*"))


@pytest.mark.slow
def test_node_0_alone_says_whom_it_waits_for_and_a_define_or_set_is_refused(project):
    endpoint = f"127.0.0.1:{free_port()}"
    zero = node(0, endpoint, project)
    said(zero, rf"^node 0 of 2: serving the job's rendezvous at {endpoint} \(job forge-\w+\); "
               r"waiting for node 1 to join \(up to 600 s\)$")  # fmt: skip
    one = node(1, endpoint, project, "-D", "max_steps=12", "--set", "trainer.args.seed=3")
    codes = finish([zero, one])
    assert codes == [2, 2], [zero.text(), one.text()]
    (message,) = errors(zero)
    assert "trainer.args.max_steps (node 0: 40, node 1: 12)" in message
    assert "trainer.args.seed (node 0: 42, node 1: 3)" in message
    assert errors(one) == [message]
    assert not list((project / "output" / "train").glob("run_*"))


def test_an_endpoint_no_job_can_use_is_named_within_seconds(project):
    """A port held by a program that accepts and never answers, a host that does not resolve
    (given, or SLURM's first host): each node says which, exit 2, no traceback, and never that
    a connection was lost."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts (the kernel does), never answers
    silent = f"127.0.0.1:{listener.getsockname()[1]}"
    slurm = {
        "SLURM_JOB_ID": "4713",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "node[01-02]",
    }
    try:
        jobs = [
            node(0, silent, project),
            node(1, silent, project),
            node(1, "badhost:29400", project),
            start([sys.executable, "-m", "forge.cli", "train", "-p", str(project), *SMALL], slurm),
        ]
        codes = finish(jobs)
    finally:
        listener.close()
    texts = [job.text() for job in jobs]
    assert codes == [2, 2, 2, 2], texts
    port = silent.rpartition(":")[2]
    assert f"port {port} of this machine" in texts[0]
    assert "taken by a program that accepts connections but does not answer" in texts[0]
    assert f"{silent} accepts connections but does not answer" in texts[1]
    assert "'badhost' (--rdzv-endpoint badhost:29400) does not resolve" in texts[2]
    assert (
        "'node01' (the first host of SLURM_JOB_NODELIST=node[01-02]) does not resolve" in texts[3]
    )
    for job, text in zip(jobs, texts, strict=True):
        assert len(errors(job)) == 1, text
        assert "Traceback" not in text and "frame #" not in text and "lost" not in text, text
    assert not list((project / "output" / "train").glob("run_*"))


@pytest.mark.slow
def test_a_second_job_on_a_busy_endpoint_fails_at_once_and_the_first_trains_on(project):
    """The first job trains (for as long as the test needs: it is stopped at the end); the
    second job's node 0 finds the port taken and node 1 finds its rank taken, at once."""
    endpoint = f"127.0.0.1:{free_port()}"
    first = [node(rank, endpoint, project, "-D", "max_steps=100000") for rank in (0, 1)]
    run_dir = wait_for_checkpoint(project, first, "checkpoint-000010")
    second = [node(rank, endpoint, project) for rank in (0, 1)]
    assert finish(second) == [2, 2], [job.text() for job in second]
    assert all(job.proc.poll() is None for job in first)  # untouched by the second job
    (taken,) = errors(second[0])
    assert "is taken by another forge job (job forge-" in taken and "2 nodes)" in taken
    (there,) = errors(second[1])
    assert f"node 1 of 2: the job at {endpoint} has its node 1 already" in there
    assert "another job is using this endpoint" in there
    for job in first:
        os.killpg(job.proc.pid, signal.SIGKILL)
    assert finish(first) == [-signal.SIGKILL] * 2
    assert [p.name for p in (project / "output" / "train").glob("run_*")] == [run_dir.name]


@pytest.mark.slow
def test_hybrid_sharding_on_two_nodes_shards_within_a_node_and_the_plain_trainer_continues(
    project,
):
    """`fsdp: hybrid_shard` on two nodes of 2 processes: a 2 x 2 mesh by default (replicas
    across the nodes, shards within a node): node 0's two ranks write the shards, node 1's (the
    other replica, the same rows) nearly empty files; one process with the plain trainer
    continues the checkpoint from there."""
    from forge.checkpoint import read_manifest
    from forge.checkpoint.weights import read_weights

    settings = [*SMALL, "-D", "max_steps=10", "-D", "save_steps=5", "-D", "eval_steps=1000"]
    hybrid = ["--set", "trainer.args.fsdp=hybrid_shard", "--nproc", "2"]
    jobs = nodes("train", project, *settings, *hybrid)
    codes = finish(jobs)
    assert codes == [0, 0], [job.text() for job in jobs]
    (run_dir,) = (project / "output" / "train").glob("run_*")
    checkpoint = run_dir / "checkpoints" / "checkpoint-000010"
    manifest = read_manifest(checkpoint)
    files = manifest.components["model"]["files"]
    assert files == [f"model-shard-{r:05d}-of-00004.safetensors" for r in range(4)]
    sizes = [manifest.files[name]["size"] for name in files]
    assert min(sizes[:2]) > 50 * max(sizes[2:]), sizes  # the second replica's copies: unwritten
    weights = read_weights(checkpoint)

    more = ["--set", "trainer.args.max_steps=15", "--set", "trainer.args.fsdp=null"]
    plain = subprocess.run(
        [sys.executable, "-m", "forge.cli", "resume", "-p", str(project), "--run-dir",
         str(run_dir), "--nproc", "1", *more],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    continued = read_weights(run_dir / "checkpoints" / "checkpoint-000015")
    assert sorted(continued) == sorted(weights)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}
    # it goes on from the trained weights: below the loss of step 5 (a fresh start is above)
    assert max(losses) == 15 and losses[15] < losses[5]
