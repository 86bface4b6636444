"""The manifest's integrity hash: each file entry names its algorithm (sha256 or xxh3_128),
so a checkpoint written with either verifies, and corruption is found by either."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from forge.checkpoint import CheckpointWriter, find_latest_checkpoint, read_manifest
from forge.checkpoint.io import hash_file, sync_and_hash
from forge.checkpoint.layout import validate_checkpoint
from forge.train import TrainingArgumentsError
from tests.train.common import make_args, make_trainer


def _write(directory, step: int, algorithm: str):
    with CheckpointWriter(directory, step, hash_algorithm=algorithm) as writer:
        writer.save_torch("training.pt", {"step": step, "w": torch.arange(4096.0)})
        writer.save_safetensors("model.safetensors", {"w": torch.full((512,), float(step))})
    return writer.final_path


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_each_algorithm_is_named_verified_and_finds_corruption(tmp_path, algorithm):
    path = _write(tmp_path, 10, algorithm)
    raw = json.loads((path / "manifest.json").read_text())
    for name, entry in raw["files"].items():
        assert set(entry) == {"size", algorithm}
        assert (entry["size"], entry[algorithm]) == sync_and_hash(path / name, algorithm)
    assert validate_checkpoint(path, verify_hashes=True) == []
    _flip_last_byte(path / "training.pt")  # same size: only the hash tells
    assert validate_checkpoint(path, verify_hashes=True) == [f"training.pt: {algorithm} mismatch"]


def test_checkpoints_of_both_algorithms_sit_side_by_side(tmp_path):
    _write(tmp_path, 10, "sha256")  # as every older checkpoint
    newest = _write(tmp_path, 20, "xxh3_128")
    assert find_latest_checkpoint(tmp_path, verify_hashes=True) == newest
    _flip_last_byte(newest / "model.safetensors")
    assert find_latest_checkpoint(tmp_path, verify_hashes=True).name == "checkpoint-000010"


def test_the_digests_are_the_libraries_own(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"forge" * 1000)
    import xxhash

    assert hash_file(path, "sha256") == hashlib.sha256(path.read_bytes()).hexdigest()
    assert hash_file(path, "xxh3_128") == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert hash_file(path) == hash_file(path, "xxh3_128")  # the default since it is faster


@pytest.mark.parametrize(
    "entry",
    [
        {"size": 1},  # no hash
        {"size": 1, "md5": "0" * 32},  # an algorithm forge does not know
        {"size": 1, "sha256": "0" * 32},  # a digest of the wrong length
        {"size": 1, "sha256": "0" * 64, "xxh3_128": "0" * 32},  # two: which one counts?
    ],
)
def test_a_file_entry_without_exactly_one_known_hash_is_malformed(tmp_path, entry):
    path = _write(tmp_path, 10, "xxh3_128")
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["training.pt"] = entry
    (path / "manifest.json").write_text(json.dumps(raw))
    problems = validate_checkpoint(path)
    assert len(problems) == 1 and "needs an integer size and one hash" in problems[0], problems
    with pytest.raises(Exception, match="one hash"):
        read_manifest(path)


def test_an_unknown_algorithm_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint hash 'md5'"):
        CheckpointWriter(tmp_path, 1, hash_algorithm="md5")
    with pytest.raises(TrainingArgumentsError, match="checkpoint_hash must be one of"):
        make_args(tmp_path, checkpoint_hash="md5")


def test_a_run_saving_with_xxh3_resumes(tmp_path):
    args = make_args(tmp_path, max_steps=8, save_strategy="steps", save_steps=4)
    args.checkpoint_hash = "xxh3_128"
    make_trainer(args).train()
    newest = find_latest_checkpoint(tmp_path / "checkpoints", verify_hashes=True)
    assert newest.name == "checkpoint-000008"
    assert all("xxh3_128" in e for e in read_manifest(newest).files.values())
    again = make_trainer(make_args(tmp_path, max_steps=12, save_strategy="steps", save_steps=4))
    again.train(resume_from_checkpoint=True)
    assert again.state.resumed_from == str(newest)
