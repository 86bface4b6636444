"""A checkpoint's files written in parallel and hashed while written: the commit reads back only
what no writer thread hashed (a model's ``save_pretrained`` files), ranks hand rank 0 their
hashes instead of having their files read again, and a record that does not fit its file is
not trusted."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from checkpoint_helpers import tiny_llama

from forge.checkpoint import CheckpointWriter, read_manifest, validate_checkpoint
from forge.checkpoint.storage import CheckpointStorage


class ReadBack(CheckpointStorage):
    """The local filesystem, noting every file the commit reads back to hash; ``lie`` makes
    the hashes recorded while writing wrong for the files of that rank."""

    def __init__(self, lie: int | None = None) -> None:
        self.read_back: list[str] = []
        self.lie = lie

    def hash_files(self, paths, algorithm="xxh3_128"):
        self.read_back += [p.name for p in paths]
        return super().hash_files(paths, algorithm)

    def write_torch(self, path, obj, **kwargs):
        record = super().write_torch(path, obj, **kwargs)
        if record is not None and self.lie is not None and f"rank-{self.lie:05d}" in path.name:
            return record[0] + 1, "0" * len(record[1])  # a size that is not the file's
        return record


def two_ranks(root: Path, storage: CheckpointStorage, step: int = 5) -> Path:
    """Ranks 0 and 1 as two threads of this process, meeting through a barrier."""
    barrier, failed = threading.Barrier(2), [False, False]
    errors: list[BaseException] = []

    def meet(rank: int):
        def any_failed(mine: bool) -> bool:
            failed[rank] = mine
            barrier.wait()
            result = any(failed)
            barrier.wait()
            return result

        return any_failed

    def run(rank: int) -> None:
        try:
            with CheckpointWriter(
                root, step, rank=rank, world_size=2, any_failed=meet(rank), storage=storage
            ) as writer:
                writer.save_torch(f"state-rank-{rank:05d}.pt", {"x": torch.arange(1000 + rank)})
                if rank == 1:
                    writer.save_safetensors("stage-1.safetensors", {"w": torch.ones(64, 64)})
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return root / f"checkpoint-{step:06d}"


def test_files_are_hashed_while_written_and_only_the_models_are_read_back(tmp_path):
    storage = ReadBack()
    model = tiny_llama(0)
    with CheckpointWriter(tmp_path, 3, storage=storage) as writer:
        writer.save_torch("optimizer.pt", {"moments": torch.randn(256, 256)})
        mark = writer.mark()
        writer.save_model(model)
        model_files = writer.files_since(mark)  # what the manifest lists as the model's
        writer.save_json("trainer_state.json", {"step": 3})
        writer.save_safetensors("ema.safetensors", {"w": torch.randn(32, 32)})
    checkpoint = tmp_path / "checkpoint-000003"
    assert validate_checkpoint(checkpoint) == []
    files = set(read_manifest(checkpoint).files)
    assert {"optimizer.pt", "model.safetensors", "trainer_state.json", "config.json"} <= files
    assert not any(name.startswith(".") for name in files)  # no staging left, no records
    # what save_pretrained wrote was read back once; no other file was
    assert "model.safetensors" in storage.read_back
    assert not {"optimizer.pt", "trainer_state.json", "ema.safetensors"} & set(storage.read_back)
    assert len(storage.read_back) == len(set(storage.read_back))
    # exactly the model's files, each once, not the optimizer written meanwhile
    assert model_files == sorted(set(model_files))
    assert {"model.safetensors", "config.json"} <= set(model_files)
    assert "optimizer.pt" not in model_files


def test_another_ranks_hashes_reach_the_manifest_without_its_files_being_read(tmp_path):
    storage = ReadBack()
    checkpoint = two_ranks(tmp_path, storage)
    assert validate_checkpoint(checkpoint) == []
    assert {"state-rank-00000.pt", "state-rank-00001.pt", "stage-1.safetensors"} == set(
        read_manifest(checkpoint).files
    )
    assert storage.read_back == []
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "manifest.json",
        "stage-1.safetensors",
        "state-rank-00000.pt",
        "state-rank-00001.pt",
    ]


def test_a_record_that_does_not_fit_its_file_is_hashed_again(tmp_path):
    storage = ReadBack(lie=1)
    checkpoint = two_ranks(tmp_path, storage)
    assert storage.read_back == ["state-rank-00001.pt"]  # not the other rank's wrong hash
    assert validate_checkpoint(checkpoint) == []


def test_every_file_a_checkpoint_holds_was_fsynced_before_its_rename(tmp_path, monkeypatch):
    """Files written on the writer threads (torch, safetensors, JSON), the model's, the
    manifest: each reached the disk (fsync) before the directory was renamed into place."""
    import os

    synced: set[str] = set()
    renamed: list[set[str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:  # the manifest is fsynced as manifest.json.tmp, then renamed
        synced.add(Path(os.readlink(f"/proc/self/fd/{fd}")).name.removesuffix(".tmp"))
        real_fsync(fd)

    def rename(src, dst):
        renamed.append(set(synced))  # what had been fsynced when the checkpoint appeared
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    with CheckpointWriter(tmp_path, 3) as writer:
        writer.save_model(tiny_llama(0))
        writer.save_torch("optimizer.pt", {"exp_avg": torch.ones(4096)})
        writer.save_torch("data-rank-00000.pt", {"position": torch.tensor(3)})
        writer.save_safetensors("ema.safetensors", {"w": torch.ones(128)})
        writer.save_json("trainer_state.json", {"step": 3})
    monkeypatch.undo()
    files = set(read_manifest(writer.final_path).files) | {"manifest.json"}
    assert renamed and files <= renamed[-1], sorted(files - renamed[-1])
