"""`forge train` on a disk that fills up, then `forge resume` once space is freed.

The run's directory is on a real 4 MiB tmpfs with room for one checkpoint and a half: the
step-10 checkpoint is saved, the step-20 one meets the full disk.
"""

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
from tests.small_disk import mounted_tmpfs

pytestmark = pytest.mark.integration

_LOG_ROOM = 64 * 1024  # metrics.jsonl, TensorBoard events and run.json between two saves


def _fill(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b"\0" * size)
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.slow
def test_train_on_a_full_disk_fails_cleanly_and_resumes_once_space_is_freed(
    warm_project, trained_once, tmp_path
) -> None:
    _, trained_run, _ = trained_once  # the same SMALL config: its checkpoints are ours' size
    checkpoint_size = directory_bytes(find_checkpoints(trained_run)[-1].path)
    assert checkpoint_size > 100_000
    project = tmp_path / "tiny_lm"
    shutil.copytree(warm_project, project)
    # the runs of config `train` go to output/train; the token caches stay in output/
    with mounted_tmpfs(project / "output" / "train", "4m") as disk:
        ballast = disk / "ballast"
        _fill(ballast, free_bytes(disk) - int(1.5 * checkpoint_size) - _LOG_ROOM)

        result = run_forge("train", "-p", str(project), *SMALL, "-D", "max_steps=20")
        assert result.returncode == 1, result.stderr
        run_dir = Path(result.stdout.splitlines()[0])
        checkpoints = run_dir / "checkpoints"
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, result.stderr
        message = errors[0]
        # which file meets the full disk first depends on the sizes; the checkpoint does not
        assert message.startswith("error: disk full: could not "), message
        assert str(checkpoints / "checkpoint-000020") in message, message
        assert "needs about " in message and " is free on the filesystem of " in message
        assert "save_total_limit" in message
        assert "Traceback" not in result.stderr

        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "failed"
        assert record["error"].startswith("disk full: ")
        assert [info.path.name for info in find_checkpoints(checkpoints)] == ["checkpoint-000010"]
        assert sorted(os.listdir(checkpoints)) == ["checkpoint-000010"]  # no partial left
        assert validate_checkpoint(checkpoints / "checkpoint-000010") == []

        ballast.unlink()
        resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
        assert resumed.returncode == 0, resumed.stderr
        assert f"resumed from {checkpoints / 'checkpoint-000010'} at step 10" in resumed.stderr
        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "completed"
        assert record["resumes"][-1]["from"] == str(checkpoints / "checkpoint-000010")
        final = checkpoints / "checkpoint-000020"
        assert validate_checkpoint(final) == []
        assert read_manifest(final).step == 20
