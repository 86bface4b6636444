"""The nodes of a job (forge/launch/cluster.py) and the torchrun command each node runs: forge's
flags, the same options after ``--``, and SLURM's variables (a faked SLURM environment).

Real processes on two simulated nodes: tests/integration/test_multinode.py (slow)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from forge.cli import main
from forge.launch.cluster import ONE_NODE, Nodes, first_host, resolve_nodes, slurm_nodes
from forge.launch.endpoint import Here
from forge.launch.errors import LaunchUsageError
from forge.launch.torchrun import resolve_nproc, torchrun_command

# what `srun --nodes 2 --ntasks-per-node=1 forge train ...` gives the task on the second node
SLURM = {
    "SLURM_JOB_ID": "4711",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-08],cpu3",
}


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("node[01-04],gpu7", "node01"),
        ("gpu7,node[01-04]", "gpu7"),
        ("node[3,5-9]", "node3"),
        ("a-b-[001-010]", "a-b-001"),
        ("single", "single"),
        ("rack1-n[12]", "rack1-n12"),
    ],
)
def test_the_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_a_faked_slurm_step_gives_nodes_endpoint_and_rendezvous_id():
    nodes = slurm_nodes(SLURM)
    assert nodes == Nodes(2, 1, "gpu07:30211", "slurm-4711", "SLURM")  # 29500 + 4711 % 2000
    assert not nodes.creates_run
    assert slurm_nodes({**SLURM, "SLURM_NODEID": "0"}).creates_run
    assert slurm_nodes({}) is None  # no SLURM
    assert slurm_nodes({**SLURM, "SLURM_NNODES": "1", "SLURM_NTASKS": "1"}) is None


def test_slurm_one_task_per_gpu_or_no_srun_is_refused_with_the_fix():
    with pytest.raises(
        LaunchUsageError, match=r"srun started 8 tasks on 2 nodes.*--ntasks-per-node=1"
    ):
        slurm_nodes({**SLURM, "SLURM_NTASKS": "8"})
    batch_script = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(
        LaunchUsageError, match=r"not started by srun.*--nnodes 1 to train here only"
    ):
        slurm_nodes(batch_script)
    nodes, _ = resolve_nodes(nnodes=1, env=batch_script)  # the way out the message names
    assert nodes == ONE_NODE


# what `srun -N1 -n2 forge train ...` gives its second task: two tasks on one node
TWO_TASKS_ONE_NODE = {
    "SLURM_JOB_ID": "4712",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu07",
}


def test_several_slurm_tasks_on_one_node_are_refused_with_the_fix():
    """Each task would train a run of its own: refused on one node as on several, and
    --nnodes 1 does not get round it; --node-rank (each task told its node) does."""
    fix = r"srun started 2 tasks on 1 node: each task would start a job of its own.*"
    fix += r"`srun --ntasks-per-node=1 forge train \.\.\. --nproc 2`"
    with pytest.raises(LaunchUsageError, match=fix):
        slurm_nodes(TWO_TASKS_ONE_NODE)
    with pytest.raises(LaunchUsageError, match=fix):
        resolve_nodes(env=TWO_TASKS_ONE_NODE)
    with pytest.raises(LaunchUsageError, match=fix):
        resolve_nodes(nnodes=1, env=TWO_TASKS_ONE_NODE)
    told, _ = resolve_nodes(nnodes=2, node_rank=1, rdzv_endpoint="gpu07:1", env=TWO_TASKS_ONE_NODE)
    assert (told.nnodes, told.node_rank) == (2, 1)
    one_task = {**TWO_TASKS_ONE_NODE, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"}
    assert resolve_nodes(env=one_task) == (ONE_NODE, [])
    batch_script = {k: v for k, v in TWO_TASKS_ONE_NODE.items() if k != "SLURM_STEP_ID"}
    assert resolve_nodes(env=batch_script) == (ONE_NODE, [])  # one process: nothing doubles


def test_the_cli_refuses_two_tasks_on_one_node_even_for_a_dry_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    for key, value in TWO_TASKS_ONE_NODE.items():
        monkeypatch.setenv(key, value)
    project = str(Path(__file__).parents[2] / "projects" / "tiny_lm")
    assert main(["train", "-p", project, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert (
        "srun started 2 tasks on 1 node" in captured.err and "--ntasks-per-node=1" in captured.err
    )
    assert "would train" not in captured.out


def test_flags_win_over_slurm_and_name_the_endpoint():
    nodes, rest = resolve_nodes(rdzv_endpoint="head:1234", env=SLURM)
    assert (nodes.nnodes, nodes.node_rank, nodes.endpoint) == (2, 1, "head:1234")
    nodes, _ = resolve_nodes(node_rank=0, env=SLURM)
    assert nodes.creates_run and nodes.endpoint == "gpu07:30211"
    assert resolve_nodes(env={}) == (ONE_NODE, [])


def test_master_addr_and_port_are_the_endpoint_and_options_after_dashes_are_read():
    by_master, _ = resolve_nodes(nnodes=2, node_rank=1, master_addr="n0", master_port=29600, env={})
    by_endpoint, _ = resolve_nodes(nnodes=2, node_rank=1, rdzv_endpoint="n0:29600", env={})
    assert by_master == by_endpoint
    after, rest = resolve_nodes(
        torchrun_args=["--nnodes", "2", "--node_rank=1", "--rdzv-endpoint", "n0:29600", "--log-dir", "x"],
        env={},
    )  # fmt: skip
    assert after == by_endpoint and rest == ["--log-dir", "x"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"nnodes": 2}, "needs the rendezvous address every node reaches: --rdzv-endpoint"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank 2 is not below"),
        ({"rdzv_endpoint": "h:1"}, "a rendezvous endpoint is for a job of several nodes"),
        ({"nnodes": 2, "rdzv_endpoint": "h:1", "master_addr": "h"}, "give the rendezvous once"),
        ({"nnodes": 2, "torchrun_args": ["--nnodes=2"]}, "give --nnodes once"),
        ({"torchrun_args": ["--nnodes=1:4"]}, "an elastic range (MIN:MAX) is not supported"),
        ({"nnodes": 2, "master_port": 5}, "--master-port needs --master-addr"),
    ],
)
def test_node_options_that_cannot_make_a_job_are_refused(kwargs, message):
    with pytest.raises(LaunchUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_nodes(env={}, **kwargs)


def test_torchrun_commands_of_two_nodes(tmp_path):
    """Node 0 names its run; node 1 names none and says where its forge reads it; both meet
    at the c10d rendezvous (never --standalone) and agree through its store."""
    nodes0, rest = resolve_nodes(
        nnodes=2, node_rank=0, rdzv_endpoint="n0:29400", torchrun_args=["--log-dir", "L"], env={}
    )
    run = tmp_path / "run_001"
    here = Here("train", "train.yaml", run / "config.yaml")
    zero = torchrun_command(
        run, tmp_path, 4, nodes=nodes0, torchrun_args=rest, max_restarts=2, here=here
    )
    assert zero == [
        sys.executable, "-m", "forge.launch", f"--run-dir={run}", f"--project={tmp_path}",
        "--node=0", "--command=train", "--config-name=train.yaml", f"--config={run}/config.yaml",
        "--nproc_per_node=4", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29400",
        "--rdzv-id=forge", "--max-restarts=2", "--log-dir", "L",
        "-m", "forge.cli", "_worker", "-p", str(tmp_path), "--run-dir", str(run),
        "--agree-at", "n0:29400",
    ]  # fmt: skip
    nodes1 = Nodes(2, 1, "n0:29400")
    told = tmp_path / "told"
    one = torchrun_command(None, tmp_path, 4, nodes=nodes1, tell_run_dir=told, here=Here("resume"))
    assert not any(a.startswith("--run-dir") for a in one) and "--standalone" not in one
    assert one[3:6] == [f"--project={tmp_path}", "--node=1", "--command=resume"]
    assert one[one.index("_worker") :] == [
        "_worker", "-p", str(tmp_path), "--agree-at", "n0:29400", "--tell-run-dir", str(told),
    ]  # fmt: skip
    single = torchrun_command(run, tmp_path, 2)
    assert "--standalone" in single and "--agree-at" not in single
    assert not any(a.startswith(("--node=", "--command=")) for a in single)


def test_nproc_auto_is_one_process_per_gpu_or_one_on_a_cpu_machine():
    import torch

    assert resolve_nproc("auto") == max(torch.cuda.device_count(), 1)
    assert resolve_nproc(None, default=3) == 3
    with pytest.raises(LaunchUsageError, match="positive integer or 'auto'"):
        resolve_nproc("0")


def test_the_cli_refuses_a_node_job_without_an_endpoint_before_anything_runs(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    code = main(
        ["train", "-p", str(Path(__file__).parents[2] / "projects" / "tiny_lm"), "--nnodes", "2"]
    )
    assert code == 2
    assert "needs the rendezvous address every node reaches" in capsys.readouterr().err


@pytest.mark.parametrize("where", [["--nnodes", "1:2"], ["--", "--nnodes", "1:2"]])
def test_an_elastic_range_is_refused_with_one_reason_given_to_forge_or_after_dashes(
    where, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    project = str(Path(__file__).parents[2] / "projects" / "tiny_lm")
    assert main(["train", "-p", project, *where]) == 2
    err = capsys.readouterr().err
    assert "--nnodes must be a positive integer (got '1:2'); an elastic range" in err, err
    assert "invalid int value" not in err
