"""Where a checkpoint's bytes go: the file operations of a commit, as one small object.

``CheckpointWriter`` does every write, hash, fsync and rename of a save through a
``CheckpointStorage``. Production code uses the local filesystem (this class as it is); a test
wraps it to fail or to die at an exact operation of a save (tests/faults has such a wrapper),
either by passing ``storage=`` to the writer or, for whole processes (``forge train`` under
torchrun), by installing it as the process default with ``use_storage`` before training.

Each method is one step of a commit, named so that a wrapper can say "after this file",
"before the manifest" or "before the rename" without knowing how the writer works. Paths are
inside the checkpoint's temporary directory (``.tmp-checkpoint-000400/trainer.pt``) except for
``start`` and ``rename``. The file writes may run on several threads at once (a writer writes
the files of one checkpoint in parallel); given ``hash_algorithm`` they return the file's
(size, hex digest), hashed while writing; a write that returns None has its file read back and
hashed at commit instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.checkpoint.io import (
    DEFAULT_HASH,
    HashingFile,
    commit_directory,
    fsync_tree_dirs,
    map_files,
    save_model_weights,
    save_tensors,
    sync_and_hash,
    write_file_atomically,
    write_file_durably,
)
from forge.checkpoint.layout import sweep_temp_dirs

if TYPE_CHECKING:
    import torch
    from torch import nn


class CheckpointStorage:
    """The local filesystem: what every save uses unless a test installs another."""

    def start(self, checkpoints_dir: Path, path: Path) -> None:
        """Rank 0, first step of a commit: create the temporary directory ``path`` (sweeping
        what killed saves left in ``checkpoints_dir``)."""
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        sweep_temp_dirs(checkpoints_dir)
        path.mkdir()

    def write_torch(
        self, path: Path, obj: Any, *, hash_algorithm: str | None = None
    ) -> tuple[int, str] | None:
        """``torch.save`` ``obj`` to ``path``, fsynced (hashed as it is written)."""
        import torch

        with open(path, "wb") as f:
            sink = HashingFile(f, hash_algorithm) if hash_algorithm else f
            torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
        return sink.record() if isinstance(sink, HashingFile) else None

    def write_bytes(
        self, path: Path, data: bytes, *, hash_algorithm: str | None = None
    ) -> tuple[int, str] | None:
        """Write ``data`` to ``path``, fsynced."""
        return write_file_durably(path, data, hash_algorithm)

    def write_tensors(
        self,
        path: Path,
        tensors: Mapping[str, torch.Tensor],
        metadata: dict | None,
        *,
        hash_algorithm: str | None = None,
    ) -> tuple[int, str] | None:
        """One safetensors file, fsynced."""
        return save_tensors(path, tensors, metadata, hash_algorithm)

    def write_model(
        self,
        directory: Path,
        model: nn.Module,
        state_dict: Mapping[str, torch.Tensor],
        *,
        tokenizer: Any = None,
        max_shard_size: int | str = "2GB",
    ) -> None:
        """A whole model's weights from ``state_dict`` (``save_pretrained``'s layout for a
        transformers model, whose config is written from ``model``), and the tokenizer."""
        save_model_weights(model, directory, state_dict=state_dict, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    def hash_files(self, paths: list[Path], algorithm: str = DEFAULT_HASH) -> list[tuple[int, str]]:
        """fsync every file and return its (size, hex digest of ``algorithm``), a few files at
        a time."""
        return map_files(functools.partial(sync_and_hash, algorithm=algorithm), paths)

    def write_manifest(self, path: Path, data: bytes) -> None:
        """Write ``manifest.json`` atomically, then fsync every directory of the checkpoint."""
        write_file_atomically(path, data)
        fsync_tree_dirs(path.parent)

    def rename(self, path: Path, final_path: Path) -> None:
        """The commit point: the complete temporary directory takes its final name."""
        commit_directory(path, final_path)


_default: CheckpointStorage = CheckpointStorage()


def default_storage() -> CheckpointStorage:
    """The storage a writer uses when it is given none."""
    return _default


def use_storage(storage: CheckpointStorage) -> CheckpointStorage:
    """Make ``storage`` this process's default (tests: a wrapper that injects faults);
    returns the previous default, to put back."""
    global _default
    previous, _default = _default, storage
    return previous
