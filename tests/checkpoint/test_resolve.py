"""The one resolver: what a user types where a checkpoint is expected -> a validated checkpoint,
hashed once, or an error naming the path and what to do."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import forge.checkpoint.layout as layout
from forge.checkpoint import CheckpointWriter
from forge.checkpoint.resolve import (
    Checkpoint,
    CheckpointNotFound,
    CheckpointUsageError,
    Restart,
    resolve_checkpoint,
    resume_checkpoint,
    use_run_lookup,
)
from forge.runs import PROJECT_RUNS, RunRecord


@pytest.fixture(autouse=True)
def run_lookup():
    """A project directory and --best are read through forge.runs, as forge's entry points
    (the CLI, the worker) install it."""
    previous = use_run_lookup(PROJECT_RUNS)
    yield
    use_run_lookup(previous)


def make_checkpoint(checkpoints: Path, step: int, *, valid: bool = True) -> Path:
    with CheckpointWriter(checkpoints, step) as writer:
        writer.save_json("state.json", {"step": step})
    if not valid:  # the same size, other bytes: only its hash tells
        state = writer.final_path / "state.json"
        state.write_bytes(state.read_bytes().replace(b"step", b"stap"))
    return writer.final_path


def make_run(root: Path, name: str = "run_001", best: int | None = None) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    data = {"run": int(name.split("_")[1]), "config": "c.yaml", "created_ns": 0, "best": None}
    if best is not None:
        data["best"] = {"checkpoint": f"checkpoints/checkpoint-{best:06d}", "metric": "loss"}
    RunRecord(run_dir, data).save()
    return run_dir


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """Every file hashed by validation, in order (a wrapper around the hash function)."""
    calls: list[Path] = []
    original = layout.hash_file

    def counting(path: Path) -> str:
        calls.append(Path(path))
        return original(path)

    monkeypatch.setattr(layout, "hash_file", counting)
    return calls


def test_a_checkpoint_directory_comes_back_with_its_manifest_hashed_once(tmp_path, hashed):
    path = make_checkpoint(tmp_path / "run_001" / "checkpoints", 40)
    found = resolve_checkpoint(path)
    assert isinstance(found, Checkpoint)
    assert found.path == path and found.step == 40 and found.hashes_verified
    assert set(found.manifest.files) == {"state.json"}
    assert hashed == [path / "state.json"]
    assert resolve_checkpoint(found) is found  # a resolved checkpoint is never hashed again
    assert resume_checkpoint(found, tmp_path) is found
    assert len(hashed) == 1


def test_a_run_or_its_checkpoints_directory_gives_the_newest_valid_one(tmp_path, caplog):
    run_dir = make_run(tmp_path / "output" / "c")
    checkpoints = run_dir / "checkpoints"
    make_checkpoint(checkpoints, 10)
    second = make_checkpoint(checkpoints, 20)
    make_checkpoint(checkpoints, 30, valid=False)
    with caplog.at_level(logging.WARNING, logger="forge.checkpoint"):
        assert resolve_checkpoint(run_dir).path == second
    assert "skipping checkpoint-000030: state.json: xxh3_128 mismatch" in caplog.text
    assert resolve_checkpoint(checkpoints).path == second
    assert resume_checkpoint(run_dir, tmp_path).path == second


def test_a_project_directory_gives_its_newest_run(tmp_path):
    (tmp_path / "meta.yaml").write_text("name: p\ndescription: d\n")
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    with pytest.raises(CheckpointNotFound, match="the project has no runs under .*forge train"):
        resolve_checkpoint(tmp_path)
    old = make_run(tmp_path / "output" / "c", "run_001")
    make_checkpoint(old / "checkpoints", 50)
    new = make_run(tmp_path / "output" / "c", "run_002")
    RunRecord(new, {**RunRecord.load(new).data, "created_ns": 1}).save()
    newest = make_checkpoint(new / "checkpoints", 10)
    assert resolve_checkpoint(tmp_path).path == newest


def test_best_is_the_runs_best_and_refused_for_a_checkpoint(tmp_path):
    run_dir = make_run(tmp_path, best=10)
    best = make_checkpoint(run_dir / "checkpoints", 10)
    newest = make_checkpoint(run_dir / "checkpoints", 20)
    assert resolve_checkpoint(run_dir, best=True).path == best.resolve()
    assert resolve_checkpoint(run_dir).path == newest
    with pytest.raises(
        CheckpointUsageError, match="--best picks a run's best checkpoint, and .* is a"
    ):
        resolve_checkpoint(newest, best=True)
    without = make_run(tmp_path, "run_002")
    make_checkpoint(without / "checkpoints", 10)
    with pytest.raises(CheckpointNotFound, match="has no best checkpoint.*metric_for_best_model"):
        resolve_checkpoint(without, best=True)


def test_what_names_no_valid_checkpoint_is_a_located_error(tmp_path):
    with pytest.raises(CheckpointNotFound, match=f"{tmp_path / 'nope'}: no such checkpoint"):
        resolve_checkpoint(tmp_path / "nope")
    run_dir = make_run(tmp_path)
    with pytest.raises(CheckpointNotFound, match=f"{run_dir}: no valid checkpoint"):
        resolve_checkpoint(run_dir)
    broken = make_checkpoint(run_dir / "checkpoints", 10, valid=False)
    with pytest.raises(CheckpointNotFound) as error:
        resolve_checkpoint(broken)
    assert (
        str(error.value)
        == f"{broken} is not a valid checkpoint:\n  - state.json: xxh3_128 mismatch"
    )
    with pytest.raises(CheckpointNotFound, match=f"cannot resume from {broken}:\n  - state.json"):
        resume_checkpoint(broken, tmp_path)


def test_a_checkpoint_without_its_manifest_is_refused_and_a_model_directory_named(tmp_path):
    """A checkpoint whose manifest is gone was cut short: refused, even with a config.json. A
    Hugging Face model directory (another tool's, an export) is taken only where a command
    reads a model alone, as what it is: no manifest, nothing hashed."""
    checkpoint = make_checkpoint(tmp_path / "run_001" / "checkpoints", 10)
    (checkpoint / "manifest.json").unlink()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFound, match="manifest.json: missing"):
        resolve_checkpoint(checkpoint, models=True)
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    found = resolve_checkpoint(exported, models=True)
    assert found.path == exported and found.manifest is None and not found.hashes_verified
    with pytest.raises(CheckpointNotFound, match=f"{exported}: no valid checkpoint"):
        resolve_checkpoint(exported)  # evaluate, resume: a run's checkpoint only
    with pytest.raises(CheckpointNotFound, match=f"{exported}: no valid checkpoint"):
        resume_checkpoint(exported, tmp_path)


def test_resume_true_and_a_restart(tmp_path, caplog):
    run_dir = make_run(tmp_path / "output" / "c")
    with caplog.at_level(logging.WARNING, logger="forge.checkpoint"):
        assert resume_checkpoint(True, run_dir) is None
    assert "no valid checkpoint" in caplog.text
    assert resume_checkpoint(False, run_dir) is None and resume_checkpoint(None, run_dir) is None
    elsewhere = resolve_checkpoint(make_checkpoint(tmp_path / "other", 5))
    assert resume_checkpoint(Restart(run_dir, elsewhere), run_dir) is elsewhere
    assert resume_checkpoint(Restart(run_dir), run_dir) is None
    own = make_checkpoint(run_dir / "checkpoints", 20)
    assert resume_checkpoint(Restart(run_dir, elsewhere), run_dir).path == own
