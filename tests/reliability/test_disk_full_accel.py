"""The full-disk guarantees hold for the Accelerate trainer too (1 and 2 processes): the save
that meets the full disk fails with one located message and exit 1, leaves no partial
checkpoint and the earlier one valid, and `forge resume` continues once space is freed.
(tests/integration/test_disk_full_cli.py has the same for the plain trainer.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from forge.checkpoint import find_checkpoints, read_manifest, validate_checkpoint
from forge.checkpoint.io import directory_bytes, free_bytes
from tests.helpers import run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_disk_full_cli import _LOG_ROOM, _fill
from tests.small_disk import mounted_tmpfs

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_accelerate_trainer_on_a_full_disk_fails_cleanly_and_resumes(
    warm_project, trained_once, tmp_path, nproc
) -> None:
    _, trained_run, _ = trained_once
    checkpoint_size = directory_bytes(find_checkpoints(trained_run)[-1].path)
    project = tmp_path / "tiny_lm"
    shutil.copytree(warm_project, project)
    with mounted_tmpfs(project / "output" / "accel", "4m") as disk:
        ballast = disk / "ballast"
        _fill(ballast, free_bytes(disk) - int(1.5 * checkpoint_size) - _LOG_ROOM)

        args = ["accel", "-p", str(project), *SMALL, "-D", "max_steps=20", "--nproc", str(nproc)]
        result = run_forge("train", *args)
        assert result.returncode == 1, result.stderr
        run_dir = Path(result.stdout.splitlines()[0])
        checkpoints = run_dir / "checkpoints"
        errors = [line for line in result.stderr.splitlines() if "error: " in line]
        assert errors, result.stderr
        assert any(
            line.startswith("error: disk full: could not ")
            and str(checkpoints / "checkpoint-000020") in line
            and "save_total_limit" in line
            for line in errors
        ), result.stderr
        assert "Traceback" not in result.stderr

        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "failed" and record["error"].startswith("disk full: ")
        assert sorted(os.listdir(checkpoints)) == ["checkpoint-000010"]  # no partial left
        assert validate_checkpoint(checkpoints / "checkpoint-000010") == []
        assert read_manifest(checkpoints / "checkpoint-000010").trainer == "accelerate"

        ballast.unlink()
        resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed from {checkpoints / 'checkpoint-000010'} at step 10" in resumed.stderr
        assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
        assert validate_checkpoint(checkpoints / "checkpoint-000020") == []
