"""Every kind of damaged checkpoint is found before anything is loaded, named, skipped by
discovery and reported by `forge checkpoints --verify`, through the real command line; under
-m slow, `forge resume` of each continues from the newest good checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from forge.checkpoint.io import DEFAULT_HASH, sync_and_hash
from forge.checkpoint.resolve import resume_checkpoint
from tests.helpers import run_forge

pytestmark = pytest.mark.integration


def rehash(checkpoint: Path, *names: str) -> None:
    """Make the manifest agree with the files again: damage only their contents can show."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in names:
        size, sha = sync_and_hash(checkpoint / name)
        manifest["files"][name] = {"size": size, DEFAULT_HASH: sha}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))


def edit_manifest(checkpoint: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    change(manifest)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))


def truncated(ckpt: Path) -> str:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    return f"model.safetensors: size {len(data) // 2} bytes, manifest says {len(data)}"


def altered(ckpt: Path) -> str:
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0x55  # same size, other bytes
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    return "optimizer.pt: xxh3_128 mismatch"


def missing_file(ckpt: Path) -> str:
    (ckpt / "rng-rank-00000.pt").unlink()
    return "rng-rank-00000.pt: listed in manifest but missing"


def extra_file(ckpt: Path) -> str:
    (ckpt / "stray.bin").write_bytes(b"left by a copy tool")
    return "stray.bin: present but not in the manifest"


def missing_manifest(ckpt: Path) -> str:
    (ckpt / "manifest.json").unlink()
    return "manifest.json: missing (checkpoint incomplete)"


def malformed_manifest(ckpt: Path) -> str:
    (ckpt / "manifest.json").write_text('{"format_version": 2, "step": 40, "files": [')
    return "manifest.json: corrupt (Expecting value: line 1 column"


def shard_from_another_step(ckpt: Path) -> str:
    # the step-30 optimizer state under the step-40 name, the manifest updated to match it
    shutil.copy(ckpt.with_name("checkpoint-000030") / "optimizer.pt", ckpt / "optimizer.pt")
    rehash(ckpt, "optimizer.pt")
    return (
        "optimizer.pt: written for another checkpoint, rank or stage: its header says "
        "step 30 (expected 40)"
    )


def topology_mismatch(ckpt: Path) -> str:
    edit_manifest(ckpt, lambda m: m["topology"].update(world_size=2, dp_size=2))
    return (
        "component 'data' (rank): files ['data-rank-00000.pt'] do not match its topology "
        "(world_size 2, num_stages 1), which needs ['data-rank-00000.pt', 'data-rank-00001.pt']"
    )


def leftover_temporary(ckpt: Path) -> str:
    partial = ckpt.with_name(".tmp-checkpoint-000050")
    shutil.copytree(ckpt, partial)
    (partial / "manifest.json").unlink()  # a save killed before its manifest
    return "leftover: a save that did not finish; never loaded, the next save removes it"


CASES = {
    "truncated": (truncated, 30),
    "altered": (altered, 30),
    "missing-file": (missing_file, 30),
    "extra-file": (extra_file, 30),
    "missing-manifest": (missing_manifest, 30),
    "malformed-manifest": (malformed_manifest, 30),
    "shard-from-another-step": (shard_from_another_step, 30),
    "topology-mismatch": (topology_mismatch, 30),
    "leftover-temporary-dir": (leftover_temporary, 40),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damage_is_named_skipped_and_reported_before_loading(trained, case):
    project, run_dir, _ = trained
    damage, resumes_at = CASES[case]
    checkpoints = run_dir / "checkpoints"
    message = damage(checkpoints / "checkpoint-000040")

    table = run_forge("checkpoints", "-p", str(project), "--verify")
    assert "Traceback" not in table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    if case == "leftover-temporary-dir":
        assert table.returncode == 0, table.stdout + table.stderr  # debris, not a bad checkpoint
        assert message in rows["train/run_001/checkpoints/.tmp-checkpoint-000050"]
        assert rows["train/run_001/checkpoints/checkpoint-000040"].endswith("valid")
    else:
        assert table.returncode == 1, table.stdout + table.stderr
        assert "INVALID: " in rows["train/run_001/checkpoints/checkpoint-000040"]
        assert message in rows["train/run_001/checkpoints/checkpoint-000040"]
    assert rows["train/run_001/checkpoints/checkpoint-000030"].endswith("valid")

    # discovery (what `forge resume` runs first) passes it over
    assert resume_checkpoint(run_dir, run_dir).path == checkpoints / f"checkpoint-{resumes_at:06d}"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_continues_from_the_newest_good_checkpoint(trained, case):
    project, run_dir, _ = trained
    damage, resumes_at = CASES[case]
    checkpoints = run_dir / "checkpoints"
    message = damage(checkpoints / "checkpoint-000040")
    longer = f"trainer.args.max_steps={resumes_at + 1}"
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), "--set", longer)
    assert resumed.returncode == 0, resumed.stderr
    origin = checkpoints / f"checkpoint-{resumes_at:06d}"
    assert f"resumed from {origin} at step {resumes_at}" in resumed.stderr
    if resumes_at == 30:
        assert f"skipping checkpoint-000040: {message}" in resumed.stderr
    else:
        assert not (checkpoints / ".tmp-checkpoint-000050").exists()  # swept by the next save
