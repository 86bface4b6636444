"""A checkpoint can never run code: not on `forge checkpoints --verify`, not on `forge resume`.

A checkpoint's state files are rewritten to hold an object whose unpickling would create a
marker file, with the manifest's sizes and hashes updated so the checkpoint looks consistent:
validation refuses the file by name (it reads every state file's header with
``weights_only=True``), discovery skips the checkpoint, `forge resume --from` it fails, and the
marker never appears. Shared files, a per-rank file and a stage-scoped file are each tried.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from forge.checkpoint import validate_checkpoint
from tests.helpers import run_forge

pytestmark = pytest.mark.integration

KINDS = {
    "shared": ["trainer.pt", "lr_scheduler.pt", "callbacks.pt"],
    "per-rank": ["rng-rank-00000.pt"],
    "stage": ["optimizer.pt"],  # stage-scoped; one stage keeps the plain name
}


class CreatesMarker:
    """Unpickling this opens (so creates) ``path`` for writing."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant(checkpoint, names, marker) -> None:
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for name in names:
        assert name in manifest["files"], manifest["files"]
        path = checkpoint / name
        payload = torch.load(path, weights_only=True)
        payload["hook"] = CreatesMarker(str(marker))  # beside the header and the state
        torch.save(payload, path)
        data = path.read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k == "per-rank" else k for k in KINDS]
)
def test_a_state_file_carrying_a_pickled_callable_is_refused_unrun(trained, tmp_path, kind):
    project, run_dir, _ = trained
    checkpoint = run_dir / "checkpoints" / "checkpoint-000040"
    names = KINDS[kind]
    marker = tmp_path / "code-ran"
    plant(checkpoint, names, marker)
    assert validate_checkpoint(checkpoint, verify_hashes=False) == []  # sizes all agree

    first = sorted(names)[0]  # problems come in component order
    problems = validate_checkpoint(checkpoint)
    for name in names:
        assert any(p.startswith(f"{name}: refusing to load: ") for p in problems), problems
    assert not marker.exists()

    table = run_forge("checkpoints", "-p", str(project), "--verify")
    assert table.returncode == 1, table.stdout + table.stderr
    row = next(line for line in table.stdout.splitlines() if "checkpoint-000040" in line)
    assert f"INVALID: {first}: refusing to load: it holds Python objects" in row
    assert not marker.exists()

    explicit = run_forge("resume", "-p", str(project), "--from", str(checkpoint))
    assert explicit.returncode == 1, explicit.stderr
    assert f"cannot resume from {checkpoint}:" in explicit.stderr
    assert f"{first}: refusing to load" in explicit.stderr
    assert "Traceback" not in explicit.stderr
    assert not marker.exists(), "loading the checkpoint ran code"

    resumed = run_forge(
        "resume",
        "-p",
        str(project),
        "--run-dir",
        str(run_dir),
        "--set",
        "trainer.args.max_steps=31",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping checkpoint-000040: {first}: refusing to load" in resumed.stderr
    previous = run_dir / "checkpoints" / "checkpoint-000030"
    assert f"resumed from {previous} at step 30" in resumed.stderr
    assert not marker.exists(), "loading the checkpoint ran code"
