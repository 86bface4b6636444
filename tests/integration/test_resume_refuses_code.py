"""`forge resume` never runs code a checkpoint carries.

A checkpoint's shared state files are rewritten to hold an object whose unpickling would
create a marker file, with the manifest's sizes and hashes updated so the checkpoint
validates: the resume must refuse the file by name and the marker must never appear.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from forge.checkpoint import find_latest_checkpoint, validate_checkpoint
from tests.helpers import run_forge

pytestmark = pytest.mark.integration

_PER_RANK = re.compile(r"rank", re.IGNORECASE)


class CreatesMarker:
    """Unpickling this opens (so creates) ``path`` for writing."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_resume_refuses_a_state_file_carrying_a_pickled_callable(trained, tmp_path):
    project, run_dir, _ = trained
    checkpoint = find_latest_checkpoint(run_dir / "checkpoints")
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    # the shared state files, whatever they are called: .pt entries that are not per rank
    shared = [n for n in manifest["files"] if n.endswith(".pt") and not _PER_RANK.search(n)]
    assert shared, manifest["files"]
    marker = tmp_path / "code-ran"
    for name in shared:
        path = checkpoint / name
        state = torch.load(path, weights_only=True)
        torch.save({"state": state, "hook": CreatesMarker(str(marker))}, path)
        data = path.read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    assert validate_checkpoint(checkpoint) == []  # nothing but the contents gives it away

    result = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert result.returncode in (1, 2), result.stderr
    assert not marker.exists(), "loading the checkpoint ran code"
    assert "Traceback" not in result.stderr
    assert any(str(checkpoint / name) in result.stderr for name in shared), result.stderr
    assert "refusing to load" in result.stderr
