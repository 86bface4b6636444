"""The test-only fault points inside a save (tests/faults, a wrapper of the storage seam in
forge/checkpoint/storage.py): where they fire and what a failure there leaves behind. The CLI
tests (tests/integration/test_save_faults.py) drive them through real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint import CheckpointError, CheckpointWriter, find_checkpoints
from tests.faults import FaultyStorage, fault_env, inject

REPO = Path(__file__).resolve().parents[2]


def save(checkpoints_dir, step: int) -> None:
    with CheckpointWriter(checkpoints_dir, step) as writer:
        writer.save_model(nn.Linear(4, 4))
        writer.save_torch("trainer.pt", {"step": step})
        writer.save_torch("rng-rank-00000.pt", {"state": torch.arange(3)})


@pytest.mark.parametrize(
    "point", ["after:model", "after:trainer.pt", "before-manifest", "before-rename"]
)
def test_a_failure_at_each_point_leaves_only_the_earlier_checkpoints(tmp_path, monkeypatch, point):
    save(tmp_path, 1)
    inject(monkeypatch, fail=f"{point}@2")
    with pytest.raises(CheckpointError, match=f"injected at {point} of step 2 on rank 0"):
        save(tmp_path, 2)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]
    save(tmp_path, 3)  # another step, or another rank, is untouched
    inject(monkeypatch, fail=f"{point}@4:1")
    save(tmp_path, 4)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1, 3, 4]


def test_a_kill_point_ends_the_process_mid_save(tmp_path):
    code = (
        "import sys; from tests.checkpoint.test_faults import save; "
        "save(sys.argv[1], 1); save(sys.argv[1], 2)"
    )
    env = dict(os.environ, **fault_env(kill="after:trainer.pt@2"))
    env["PYTHONPATH"] += os.pathsep + str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert [c.step for c in find_checkpoints(tmp_path)] == [1]
    written = {p.name for p in (tmp_path / ".tmp-checkpoint-000002").iterdir()}
    # killed right after it: the files written beside it on other writer threads may be there
    # or not (a checkpoint's files are written in parallel), the manifest is not
    assert "trainer.pt" in written
    assert "manifest.json" not in written


def test_a_bad_spec_is_named():
    with pytest.raises(ValueError, match="not POINT@STEP"):
        FaultyStorage(fail="before-manifest@x")
