"""`forge train` with ``async_save: true`` on a disk that fills up during a background commit.

The run's directory is on a real 4 MiB tmpfs with room for one checkpoint and a half: the
step-10 checkpoint is committed in the background, the step-20 one meets the full disk while
the loop trains on; the run fails with the disk-full message, nothing is left half-written and
the step-10 checkpoint still validates and resumes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from forge.checkpoint import find_checkpoints, read_manifest, validate_checkpoint
from forge.checkpoint.io import directory_bytes, free_bytes
from tests.faults import fault_env
from tests.helpers import run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_disk_full_cli import _LOG_ROOM, _fill
from tests.small_disk import mounted_tmpfs

pytestmark = pytest.mark.integration

ASYNC = ["--set", "trainer.args.async_save=true"]


@pytest.mark.slow
def test_a_full_disk_during_an_async_commit_fails_the_run_cleanly(
    warm_project, trained_once, tmp_path
) -> None:
    _, trained_run, _ = trained_once
    checkpoint_size = directory_bytes(find_checkpoints(trained_run)[-1].path)
    project = tmp_path / "tiny_lm"
    shutil.copytree(warm_project, project)
    with mounted_tmpfs(project / "output" / "train", "4m") as disk:
        ballast = disk / "ballast"
        _fill(ballast, free_bytes(disk) - int(1.5 * checkpoint_size) - _LOG_ROOM)

        # 40 steps: the step-20 commit fails while steps 21.. train
        result = run_forge("train", "-p", str(project), *SMALL, *ASYNC, "-D", "max_steps=40")
        assert result.returncode == 1, result.stderr
        run_dir = Path(result.stdout.splitlines()[0])
        checkpoints = run_dir / "checkpoints"
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, result.stderr
        message = errors[0]
        assert message.startswith("error: disk full: could not "), message
        assert str(checkpoints / "checkpoint-000020") in message, message
        assert "save_total_limit" in message
        assert "Traceback" not in result.stderr

        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "failed"
        assert record["error"].startswith("disk full: ")
        assert [c["step"] for c in record["checkpoints"]] == [10]
        assert [info.path.name for info in find_checkpoints(checkpoints)] == ["checkpoint-000010"]
        assert sorted(os.listdir(checkpoints)) == ["checkpoint-000010"]  # no partial left
        assert validate_checkpoint(checkpoints / "checkpoint-000010") == []

        ballast.unlink()
        resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed from {checkpoints / 'checkpoint-000010'} at step 10" in resumed.stderr
        assert read_manifest(checkpoints / "checkpoint-000040").step == 40


def test_async_save_on_the_command_line_trains_and_resumes(warm_project, tmp_path) -> None:
    """Every save of a run is committed, listed in run.json and valid once the run ends."""
    project = tmp_path / "tiny_lm"
    shutil.copytree(warm_project, project)
    result = run_forge("train", "-p", str(project), *SMALL, *ASYNC, "-D", "max_steps=30")
    assert result.returncode == 0, result.stderr
    run_dir = Path(result.stdout.splitlines()[0])
    steps = [info.step for info in find_checkpoints(run_dir / "checkpoints")]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed"
    assert [c["step"] for c in record["checkpoints"]][-1] == 30
    assert steps[-1] == 30
    for info in find_checkpoints(run_dir / "checkpoints", verify_hashes=True):
        assert info.valid, info.problems


@pytest.mark.slow
@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_failed_async_write_on_one_rank_fails_every_rank(
    warm_project, tmp_path, failing_rank
) -> None:
    """2 processes: one rank's background commit of step 20 fails while both train on. Every
    rank stops (run_forge's timeout would fail the test on a hang), the run fails with the
    failing rank's message, and the step-10 checkpoint stays valid and resumes."""
    project = tmp_path / "tiny_lm"
    shutil.copytree(warm_project, project)
    point = f"after:rng-rank-{failing_rank:05d}.pt"
    result = run_forge(
        "train",
        "-p",
        str(project),
        *SMALL,
        *ASYNC,
        "-D",
        "max_steps=40",
        "--nproc",
        "2",
        env=fault_env(fail=f"{point}@20:{failing_rank}"),
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    prefix = "[rank 1] " if failing_rank else ""
    assert f"{prefix}error: could not write rng-rank-{failing_rank:05d}.pt" in result.stderr
    assert f"injected at {point} of step 20 on rank {failing_rank}" in result.stderr
    assert "Traceback" not in result.stderr
    run_dir = Path(result.stdout.splitlines()[0])
    checkpoints = run_dir / "checkpoints"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["error_kind"] == "runtime"
    assert [c["step"] for c in record["checkpoints"]] == [10]
    assert sorted(os.listdir(checkpoints)) == ["checkpoint-000010"]  # nothing half-written
    assert validate_checkpoint(checkpoints / "checkpoint-000010") == []

    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoints / 'checkpoint-000010'} at step 10" in resumed.stderr
