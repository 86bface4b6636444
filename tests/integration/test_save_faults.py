"""Crashes and failures inside a checkpoint save, through the real CLI.

A test-only fault point (tests/faults, wrapping the checkpoint storage) kills a process, or fails a write,
at an exact point of the step-20 (or step-10) save. Killed between two file writes or between
the last file and the manifest, a run continued with `forge resume` ends bit-identical to the
same run trained straight through, with 1 and with 2 processes. A failure on either rank of a
2-process job ends every rank with exit 1 and the failing rank's message, never a hang.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.faults import fault_env
from tests.helpers import run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import final_state
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration

# killed between two file writes, or with every file written but no manifest
ONE_PROCESS_KILLS = {
    "between-files": "after:optimizer.pt@20",
    "before-manifest": "before-manifest@20",
}
# rank 1 dies between its own writes while rank 0 waits for it; rank 0 dies at the manifest
TWO_PROCESS_KILLS = {
    "rank1-between-files": "after:rng-rank-00001.pt@20:1",
    "rank0-before-manifest": "before-manifest@20:0",
}


def killed_then_resumed(project: Path, kill_at: str, *extra: str) -> Path:
    killed = run_forge("train", "-p", str(project), *SMALL, *extra, env=fault_env(kill=kill_at))
    assert killed.returncode != 0, killed.stderr
    run_dir = Path(killed.stdout.splitlines()[0])
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "checkpoint-000010").is_dir()
    assert not (checkpoints / "checkpoint-000020").exists()
    assert (checkpoints / ".tmp-checkpoint-000020").is_dir()  # the save it died in
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    assert not (checkpoints / ".tmp-checkpoint-000020").exists()
    return run_dir


def assert_same_end(straight: Path, resumed: Path) -> None:
    weights_a, optim_a = final_state(straight)
    weights_b, optim_b = final_state(resumed)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ONE_PROCESS_KILLS.values(), ids=ONE_PROCESS_KILLS.keys())
def test_killed_inside_a_save_then_resumed_is_bit_identical(project, trained_once, kill_at):
    _, straight, _ = trained_once
    resumed = killed_then_resumed(project, kill_at)
    assert_same_end(straight, resumed)


@pytest.fixture(scope="module")
def straight_two_processes(warm_project, tmp_path_factory):
    dest = tmp_path_factory.mktemp("straight2") / "tiny_lm"
    shutil.copytree(warm_project, dest)
    result = run_forge("train", "-p", str(dest), *SMALL, "--nproc", "2")
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0])


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", TWO_PROCESS_KILLS.values(), ids=TWO_PROCESS_KILLS.keys())
def test_two_processes_killed_inside_a_save_then_resumed_are_bit_identical(
    project, straight_two_processes, kill_at
):
    resumed = killed_then_resumed(project, kill_at, "--nproc", "2")
    assert_same_end(straight_two_processes, resumed)


@pytest.mark.parametrize(
    ("fail_at", "failing_rank", "file"),
    [
        pytest.param("after:trainer.pt@10:0", 0, "trainer.pt", marks=pytest.mark.slow),
        ("after:rng-rank-00001.pt@10:1", 1, "rng"),
    ],
    ids=["rank0", "rank1"],
)
def test_a_failed_write_on_one_rank_ends_every_rank(project, fail_at, failing_rank, file):
    """run_forge's timeout would fail the test if any rank waited for the failed one."""
    result = run_forge(
        "train",
        "-p",
        str(project),
        *SMALL,
        "--nproc",
        "2",
        env=fault_env(fail=fail_at),
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    prefix = "[rank 1] " if failing_rank else ""
    assert f"{prefix}error: could not write {file}" in result.stderr
    assert f"injected at {fail_at.split('@')[0]} of step 10 on rank {failing_rank}" in result.stderr
    other = "" if failing_rank else "[rank 1] "
    assert f"{other}error: checkpoint checkpoint-000010 was not saved: another rank failed" in (
        result.stderr
    )
    run_dir = Path(result.stdout.splitlines()[0])
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["error_kind"] == "runtime"
    assert list((run_dir / "checkpoints").iterdir()) == []  # nothing half-written is left
