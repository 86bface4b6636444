"""forge/launch/endpoint.py in one process: node 0 serves the job's store, another node finds
it, and what each says when the endpoint is empty, taken, silent or another job's, or when the
nodes were started with different configs.

With real processes (forge on two simulated nodes): tests/integration/test_multinode.py."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from forge.launch import endpoint
from forge.launch.cluster import Nodes, check_host, resolve_nodes
from forge.launch.endpoint import Here, Notes, meet, mismatch
from forge.launch.errors import LaunchUsageError
from forge.runs import RunError

CONFIG = "trainer: !singleton:forge.train:Trainer\n  args: {max_steps: 10, seed: 1}\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def at(tmp_path):
    """A free endpoint on this machine and a config file per text."""

    def config(text: str, name: str = "train.yaml") -> Here:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(text)
        return Here("train", name, path)

    return f"127.0.0.1:{free_port()}", config


@pytest.fixture
def silent_listener():
    """A port whose listener accepts connections and never answers (no store)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join()
    for connection in held:
        connection.close()
    server.close()


def test_two_nodes_meet_under_node_0s_job_id(at):
    where, config = at
    zero = meet(0, 2, where, config(CONFIG))
    one = meet(1, 2, where, config(CONFIG), join_timeout=5)
    assert zero.job_id.startswith("forge-") and one.job_id == zero.job_id
    assert zero.missing() == [] == one.missing()
    slurm = meet(0, 2, f"127.0.0.1:{free_port()}", Here("resume"), rdzv_id="slurm-4711")
    assert slurm.job_id == "slurm-4711"  # SLURM's job id names the rendezvous as it is


def test_a_node_alone_says_at_once_whom_it_waits_for_and_gives_up_naming_node_0(at, capsys):
    where, config = at
    started = time.monotonic()
    with pytest.raises(RunError, match=rf"node 1 of 2: node 0 never served .* at {where} in 2 s"):
        meet(1, 2, where, config(CONFIG), join_timeout=2)
    assert time.monotonic() - started < 30  # a safety net: it gives up at its own timeout
    said = capsys.readouterr().err
    assert f"node 1 of 2: waiting for node 0 at {where}, where nobody answers yet" in said
    assert "(waiting up to 2 s)" in said


def test_node_0_says_whom_it_waits_for_and_when_all_joined(at, capsys):
    where, config = at
    zero = meet(0, 3, where, config(CONFIG))
    zero.watch(lambda message: None)
    said = wait_for_text(capsys, "node 0 of 3: serving the job's rendezvous")
    assert (
        f"at {where} (job {zero.job_id}); waiting for nodes 1 and 2 to join (up to 600 s)" in said
    )
    others = [meet(node, 3, where, config(CONFIG), join_timeout=5) for node in (1, 2)]
    assert "node 0 of 3: all nodes joined the job" in wait_for_text(capsys, "all nodes joined")
    assert [node.job_id for node in others] == [zero.job_id] * 2
    zero.close()


def wait_for_text(capsys, text: str) -> str:
    """stderr so far once it holds ``text`` (60 s at most: a safety net, not a timing)."""
    seen = ""
    deadline = time.monotonic() + 60
    while text not in seen and time.monotonic() < deadline:
        seen += capsys.readouterr().err
        time.sleep(0.05)
    assert text in seen, seen
    return seen


def test_notes_come_at_once_then_every_interval():
    now = [100.0]
    notes = Notes(every=30, clock=lambda: now[0])
    assert notes.due() and notes.said == 1
    now[0] += 29
    assert not notes.due()
    now[0] += 1
    assert notes.due() and notes.said == 2


def test_a_second_job_on_a_busy_endpoint_fails_at_once_on_either_node(at):
    where, config = at
    first_job = [
        meet(0, 2, where, config(CONFIG)),
        meet(1, 2, where, config(CONFIG), join_timeout=5),
    ]
    started = time.monotonic()
    with pytest.raises(
        LaunchUsageError, match=r"port \d+ of this machine .* is taken by another forge job"
    ):
        meet(0, 2, where, config(CONFIG))
    with pytest.raises(LaunchUsageError, match=r"the job at .* has its node 1 already") as err:
        meet(1, 2, where, config(CONFIG), join_timeout=5)
    assert "another job is using this endpoint, or two nodes were started with --node-rank 1" in (
        str(err.value)
    )
    assert time.monotonic() - started < 30  # a safety net: nothing waits
    assert first_job[0].missing() == []  # the first job is left as it was


def test_a_silent_listener_is_told_from_the_job_within_seconds(silent_listener, at):
    _, config = at
    where = f"127.0.0.1:{silent_listener}"
    with pytest.raises(LaunchUsageError, match="accepts connections but does not answer"):
        meet(1, 2, where, config(CONFIG), join_timeout=5)
    with pytest.raises(LaunchUsageError, match="taken by a program that accepts connections but"):
        meet(0, 2, where, config(CONFIG))


def test_a_node_with_another_config_refuses_the_job_on_every_node(at):
    where, config = at
    zero = meet(0, 2, where, config(CONFIG))
    stopped: list[str] = []
    zero.watch(stopped.append)
    other = CONFIG.replace("max_steps: 10", "max_steps: 12")
    with pytest.raises(LaunchUsageError) as err:
        meet(1, 2, where, config(other, "pipeline.yaml"), join_timeout=5)
    message = str(err.value)
    assert message.startswith("node 1 rendered another config than node 0 (node 0: train.yaml, ")
    assert "trainer.args.max_steps (node 0: 10, node 1: 12)" in message and "seed" not in message
    deadline = time.monotonic() + 60  # a safety net
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stopped == [message]  # node 0 stops with the same message


def test_node_count_and_command_must_match_node_0s():
    job = {"nnodes": 2, "command": "train", "config": CONFIG, "config_name": "train.yaml"}
    assert "started with --nnodes 3, node 0 with --nnodes 2" in mismatch(job, 1, 3, Here())
    assert "node 0 runs `forge train`, node 1 `forge resume`" in mismatch(job, 1, 2, Here("resume"))
    assert mismatch({**job, "config": None, "command": "resume"}, 1, 2, Here("resume")) is None


def test_a_host_that_does_not_resolve_is_named_before_anything_starts():
    nodes = Nodes(2, 1, "no-such-host.invalid:29400")
    with pytest.raises(LaunchUsageError, match=r"'no-such-host.invalid' \(--rdzv-endpoint no-such"):
        check_host(nodes)
    slurm = {
        "SLURM_JOB_ID": "4711",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "no-such-node.invalid[01-02]",
    }
    nodes, _ = resolve_nodes(env=slurm)
    with pytest.raises(
        LaunchUsageError, match="first host of SLURM_JOB_NODELIST=no-such-node"
    ) as err:
        check_host(nodes, env=slurm)
    assert "never connected" in str(err.value) and "lost" not in str(err.value)
    check_host(Nodes(2, 1, "127.0.0.1:29400"))  # resolves: nothing to say


def test_the_endpoint_module_imports_no_torch_until_a_node_meets():
    import subprocess
    import sys

    code = "import sys, forge.launch.endpoint; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
    assert endpoint.JOIN_TIMEOUT_S == 600  # torch's own default join_timeout
