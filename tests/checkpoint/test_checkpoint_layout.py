"""Names, manifest, validation, discovery and rotation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from forge.checkpoint import (
    CheckpointError,
    CheckpointManifest,
    checkpoint_name,
    find_checkpoints,
    find_latest_checkpoint,
    parse_checkpoint_step,
    read_manifest,
    rotate_checkpoints,
    validate_checkpoint,
)
from forge.checkpoint.io import sync_and_hash


def test_checkpoint_names_round_trip() -> None:
    assert checkpoint_name(400) == "checkpoint-000400"
    assert checkpoint_name(0) == "checkpoint-000000"
    assert checkpoint_name(12345678) == "checkpoint-12345678"
    assert parse_checkpoint_step("checkpoint-000400") == 400
    assert parse_checkpoint_step(Path("/x/run/checkpoints/checkpoint-12345678")) == 12345678
    assert parse_checkpoint_step("/x/checkpoint-000007/") == 7
    for other in (".tmp-checkpoint-000400", "checkpoint-", "checkpoint-12a", "ckpt-1", "best"):
        assert parse_checkpoint_step(other) is None
    with pytest.raises(ValueError, match="non-negative"):
        checkpoint_name(-1)


def test_manifest_lists_every_file_with_size_and_hash(write_checkpoint) -> None:
    path = write_checkpoint(400, loss=0.5)
    manifest = read_manifest(path)
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest.files) == on_disk
    assert {"model.safetensors", "training.pt", "data-rank-00000.pt"} <= set(on_disk)
    for name, entry in manifest.files.items():
        assert (entry["size"], entry["xxh3_128"]) == sync_and_hash(path / name)
    assert manifest.step == 400
    assert manifest.format_version == 2  # components and topology (forge/checkpoint/registry.py)
    assert manifest.trainer == "plain"
    assert manifest.topology == {"world_size": 1, "num_stages": 1, "dp_size": 1}
    assert manifest.components["data"] == {
        "scope": "rank",
        "weights": False,
        "files": ["data-rank-00000.pt"],
    }
    assert manifest.metrics == {"loss": 0.5}
    raw = json.loads((path / "manifest.json").read_text())
    assert CheckpointManifest.from_dict(raw) == manifest
    assert raw["created"].endswith("+00:00")
    assert validate_checkpoint(path) == []


def test_truncated_file_is_reported_by_name(write_checkpoint) -> None:
    path = write_checkpoint(100)
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 10)
    assert validate_checkpoint(path) == [
        f"model.safetensors: size {size - 10} bytes, manifest says {size}"
    ]


def test_altered_byte_is_a_hash_mismatch(write_checkpoint) -> None:
    path = write_checkpoint(100)
    state = path / "training.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert validate_checkpoint(path) == ["training.pt: xxh3_128 mismatch"]
    assert validate_checkpoint(path, verify_hashes=False) == []


def test_missing_manifest_and_missing_listed_file(write_checkpoint) -> None:
    first = write_checkpoint(100)
    (first / "data-rank-00000.pt").unlink()
    assert validate_checkpoint(first) == ["data-rank-00000.pt: listed in manifest but missing"]

    second = write_checkpoint(200)
    (second / "manifest.json").unlink()
    assert validate_checkpoint(second) == ["manifest.json: missing (checkpoint incomplete)"]
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing"):
        read_manifest(second)


def test_corrupt_manifest(write_checkpoint) -> None:
    path = write_checkpoint(100)
    (path / "manifest.json").write_text('{"step": 100, "files": ')
    [problem] = validate_checkpoint(path)
    assert problem.startswith("manifest.json: corrupt")
    (path / "manifest.json").write_text(json.dumps({"format_version": 1, "step": 100}))
    assert validate_checkpoint(path) == ["manifest.json: corrupt (no 'files')"]


def test_manifest_cannot_point_outside_the_checkpoint(write_checkpoint, tmp_path) -> None:
    path = write_checkpoint(100)
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["../../secret"] = {"size": 1, "sha256": "0" * 64}
    (path / "manifest.json").write_text(json.dumps(raw))
    assert validate_checkpoint(path) == [
        "../../secret: not a plain file name inside the checkpoint"
    ]


def test_step_must_match_directory_and_ranks_must_be_complete(write_checkpoint) -> None:
    path = write_checkpoint(100)
    raw = json.loads((path / "manifest.json").read_text())
    raw["step"] = 99
    raw["topology"]["world_size"] = 2
    (path / "manifest.json").write_text(json.dumps(raw))
    assert validate_checkpoint(path) == [
        "manifest.json: step 99 does not match checkpoint-000100",
        "component 'data' (rank): files ['data-rank-00000.pt'] do not match its topology "
        "(world_size 2, num_stages 1), which needs ['data-rank-00000.pt', 'data-rank-00001.pt']",
    ]


def test_find_checkpoints_sorted_and_temp_dirs_ignored(write_checkpoint, ckpt_dir) -> None:
    for step in (300, 20, 100):
        write_checkpoint(step)
    (ckpt_dir / ".tmp-checkpoint-000500").mkdir()
    (ckpt_dir / "checkpoint-000600.bak").mkdir()
    (ckpt_dir / "checkpoint-000700").write_text("a file, not a directory")
    (ckpt_dir / "checkpoint-000200").mkdir()  # incomplete: no manifest
    infos = find_checkpoints(ckpt_dir)
    assert [(i.step, i.valid) for i in infos] == [
        (20, True),
        (100, True),
        (200, False),
        (300, True),
    ]
    assert infos[2].problems == ["manifest.json: missing (checkpoint incomplete)"]
    assert infos[2].manifest is None
    assert infos[3].manifest.step == 300
    assert find_latest_checkpoint(ckpt_dir) == ckpt_dir / "checkpoint-000300"
    # a run directory is accepted for its checkpoints/ subdirectory
    assert find_latest_checkpoint(ckpt_dir.parent) == ckpt_dir / "checkpoint-000300"
    assert find_checkpoints(ckpt_dir / "nowhere") == []
    assert find_latest_checkpoint(ckpt_dir / "nowhere") is None


def test_find_latest_skips_invalid_newest_with_a_warning(write_checkpoint, caplog) -> None:
    write_checkpoint(100)
    write_checkpoint(200)
    newest = write_checkpoint(300)
    weights = newest / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(7)
    with caplog.at_level(logging.WARNING, logger="forge.checkpoint"):
        latest = find_latest_checkpoint(newest.parent)
    assert latest == newest.parent / "checkpoint-000200"
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage().startswith(
        f"skipping checkpoint-000300: model.safetensors: size 7 bytes, manifest says {size}"
    )


def test_find_latest_prefers_the_last_run_with_a_valid_checkpoint(tmp_path) -> None:
    from forge.checkpoint import CheckpointWriter

    def make(run: str, step: int, valid: bool = True) -> Path:
        with CheckpointWriter(tmp_path / run / "checkpoints", step) as writer:
            writer.save_json("state.json", {"step": step})
        if not valid:
            (writer.final_path / "state.json").write_text("{}")
        return writer.final_path

    make("run_001", 900)
    second = make("run_002", 300)
    make("run_003", 400, valid=False)
    runs = [tmp_path / "run_001", tmp_path / "run_002", tmp_path / "run_003"]
    assert find_latest_checkpoint(runs) == second
    assert find_latest_checkpoint([r / "checkpoints" for r in runs[:1]]).name == "checkpoint-000900"
    assert find_latest_checkpoint([]) is None


def test_rotation_keeps_limit_newest_and_protected_best(write_checkpoint, ckpt_dir) -> None:
    paths = [write_checkpoint(step) for step in (100, 200, 300, 400, 500)]
    best = paths[1]
    deleted = rotate_checkpoints(ckpt_dir, 2, protect=[best])
    assert deleted == [paths[0], paths[2], paths[3]]
    assert [i.path for i in find_checkpoints(ckpt_dir)] == [best, paths[4]]
    assert not any(p.name.startswith(".tmp-") for p in ckpt_dir.iterdir())
    # protected and newest both survive even when the limit is 1
    assert rotate_checkpoints(ckpt_dir, 1, protect=[best]) == []
    assert rotate_checkpoints(ckpt_dir, 1) == [best]
    assert rotate_checkpoints(ckpt_dir, None) == []
    with pytest.raises(ValueError, match="save_total_limit must be a positive integer"):
        rotate_checkpoints(ckpt_dir, 0)


def test_rotation_never_deletes_the_newest_loadable_checkpoint(write_checkpoint, ckpt_dir) -> None:
    paths = [write_checkpoint(step) for step in (100, 200, 300)]
    (paths[2] / "model.safetensors").unlink()  # newest is broken
    deleted = rotate_checkpoints(ckpt_dir, 1)
    assert deleted == [paths[0]]
    assert find_latest_checkpoint(ckpt_dir) == paths[1]
