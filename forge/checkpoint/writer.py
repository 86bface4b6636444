"""CheckpointWriter: every rank writes into a temporary directory that rank 0 commits at once."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

import torch
from torch import nn

from forge.checkpoint.hf import CONFIG_NAME, GENERATION_CONFIG_NAME
from forge.checkpoint.io import (
    DEFAULT_HASH,
    HASH_ALGORITHMS,
    TEMP_PREFIX,
    CheckpointError,
    DiskFullError,
    directory_bytes,
    disk_full_guard,
    estimate_checkpoint_bytes,
    list_files,
    os_error_message,
    write_weights_index,
)
from forge.checkpoint.layout import (
    MANIFEST_NAME,
    STEP_METADATA,
    CheckpointManifest,
    FileEntry,
    checkpoint_name,
    find_checkpoints,
)
from forge.checkpoint.storage import CheckpointStorage, default_storage
from forge.checkpoint.weights import directory_mismatch, weight_files
from forge.wrappers import unwrap_model

logger = logging.getLogger(__name__)

# Threads that write (and fsync, and hash) the files of one checkpoint at once: enough to keep
# a disk's queue full while the page cache takes the next file, few enough for a small machine.
FILE_WRITERS = max(2, min(4, os.cpu_count() or 1))
# What a rank other than 0 leaves in the temporary directory: the hashes of its files.
RECORDS_PREFIX = ".hashes-rank-"
# Where rank 0 writes a whole model before moving its files into the checkpoint.
MODEL_STAGING = ".model"


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # torch / numpy scalars
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _lenient_default(value: Any) -> Any:
    # an odd metric value must not cost the checkpoint: record its text instead
    try:
        return _json_default(value)
    except (TypeError, ValueError):
        return str(value)


def _dumps(obj: Any, *, lenient: bool = False) -> bytes:
    default = _lenient_default if lenient else _json_default
    return (json.dumps(obj, indent=2, default=default) + "\n").encode("utf-8")


class CheckpointWriter:
    """Write one checkpoint so that it appears complete or not at all.

    Every rank enters the context. Files go to ``.path`` (``.tmp-checkpoint-000400``); on a
    clean exit rank 0 hashes and fsyncs them, writes ``manifest.json`` last and renames the
    directory to ``.final_path``. On an exception nothing is renamed and earlier checkpoints
    stay as they were.

    Ranks meet twice (after creating the directory, after writing) through ``any_failed``:
    each passes whether it failed and learns whether any rank did, so a failure on one rank
    ends the save with an error on every rank instead of leaving the others waiting. A bare
    ``barrier`` (``torch.distributed.barrier``) may be given instead, for callers that cannot
    fail between the meetings. The meetings are the writer's only collectives; they are
    injected, so a writer running outside the training thread can meet over its own process
    group.

    ``hash_algorithm`` names the manifest's integrity hash (``xxh3_128``, the default, or
    ``sha256``); validation reads the name from the manifest, so checkpoints of either kind
    verify.

    Files are written in parallel: ``save_torch`` and ``save_safetensors`` hand their file to
    a few writer threads and return at once (what they were given must not change until the
    context exits), while ``save_model`` (and the small ``save_json``) write in the calling
    thread; each file is fsynced by the thread that wrote it and hashed as it is written (a
    whole model's files, which ``save_pretrained`` writes, are read back on a writer thread),
    so the commit only reads back files no thread recorded. Every rank other than 0 leaves
    its records beside its files for rank 0 (``.hashes-rank-00001.json``, removed at commit),
    so no file is read twice. The context's exit waits for every write; a failed write fails
    the save (the lack of space first, when several fail).

    Every file operation goes through ``storage`` (forge/checkpoint/storage.py; by default the
    process's, the local filesystem), which tests wrap to fail or die at a chosen operation.
    """

    def __init__(
        self,
        checkpoints_dir: str | os.PathLike,
        step: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Callable[[], None] | None = None,
        any_failed: Callable[[bool], bool] | None = None,
        trainer: str = "plain",
        storage: CheckpointStorage | None = None,
        hash_algorithm: str = DEFAULT_HASH,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if world_size > 1 and barrier is None and any_failed is None:
            raise ValueError(
                f"CheckpointWriter needs any_failed or a barrier when world_size is {world_size} "
                "(e.g. barrier=torch.distributed.barrier)"
            )
        self.checkpoints_dir = Path(checkpoints_dir)
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.trainer = trainer
        self.storage = storage if storage is not None else default_storage()
        if hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"unknown checkpoint hash {hash_algorithm!r}; use one of {list(HASH_ALGORITHMS)}"
            )
        self.hash_algorithm = hash_algorithm  # named in each file's manifest entry
        self.final_path = self.checkpoints_dir / checkpoint_name(step)
        self.path = self.checkpoints_dir / f"{TEMP_PREFIX}{self.final_path.name}"
        self._barrier_fn = barrier
        self._any_failed_fn = any_failed
        self._epoch: float | None = None
        self._metrics: dict[str, Any] = {}
        self._topology: dict[str, Any] = {
            "world_size": world_size,
            "num_stages": 1,
            "dp_size": world_size,
        }
        self._components: dict[str, Any] = {}
        self._weights_index: list[str] = []
        self._extra: dict[str, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[tuple[str, Future]] = []  # (file name, its write), in order
        self._records: dict[str, tuple[int, str]] = {}  # file -> (size, digest), hashed
        self._written: list[str] = []  # every file this rank writes, in order

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _any_failed(self, failed: bool) -> bool:
        """Meet the other ranks; True when any rank (this one included) failed."""
        if self._any_failed_fn is not None:
            return bool(self._any_failed_fn(failed))
        if self._barrier_fn is not None:
            self._barrier_fn()
        return failed

    def _other_rank_failed(self, doing: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.final_path.name} was not saved: another rank failed while "
            f"{doing} it (its error is reported by that rank); earlier checkpoints are untouched"
        )

    def _fail(self, exc: OSError, doing: str) -> CheckpointError:
        return CheckpointError(
            os_error_message(exc, f"could not {doing} checkpoint {self.final_path}")
            + "; earlier checkpoints are untouched"
        )

    def _space_guard(self, doing: str, pending: Any = None) -> AbstractContextManager:
        """A failure for lack of space while ``doing`` becomes one DiskFullError."""
        written = directory_bytes(self.path)
        return disk_full_guard(
            f"{doing} checkpoint {self.final_path}",
            self.checkpoints_dir,
            needed=lambda: estimate_checkpoint_bytes(
                self.path, written=written, pending=pending, previous=self._previous_checkpoint()
            ),
            cleanup=self._abort if self.is_main else None,
        )

    def _previous_checkpoint(self) -> Path | None:
        valid = [info.path for info in find_checkpoints(self.checkpoints_dir, verify_hashes=False)]
        return valid[-1] if valid else None

    # -- context ---------------------------------------------------------------------------

    def __enter__(self) -> CheckpointWriter:
        error: BaseException | None = None
        if self.is_main:
            try:
                with self._space_guard("start"):
                    self.storage.start(self.checkpoints_dir, self.path)
            except Exception as exc:  # re-raised after the others know
                error = self._fail(exc, "start") if isinstance(exc, OSError) else exc
        if self._any_failed(error is not None):
            if error is not None:
                raise error
            raise self._other_rank_failed("starting")
        if not self.path.is_dir():
            raise CheckpointError(
                f"{self.path}: not visible on rank {self.rank}; the checkpoints directory must be "
                "on a filesystem that every rank shares"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        # no thread may still write into a directory that is aborted or committed
        write_error = self._finish_writes()
        if exc is not None and not isinstance(exc, Exception):
            self._abort(say=True)  # KeyboardInterrupt, SystemExit: no meeting, the job ends
            return False
        failure = exc if exc is not None else write_error
        if isinstance(write_error, DiskFullError) and not isinstance(exc, DiskFullError):
            # a full disk explains the writes that failed beside it: its cleanup removed the
            # directory they were writing into (this thread's write, e.g., or the mkdir before it)
            failure = write_error
        if failure is None and not self.is_main:
            failure = self._leave_records()
        # every rank has written its files, or says it failed
        if self._any_failed(failure is not None):
            self._abort()
            if isinstance(failure, OSError):
                raise self._fail(failure, "write") from failure
            if exc is not None and failure is exc:
                return False
            if failure is not None:
                raise failure
            raise self._other_rank_failed("writing")
        error: Exception | None = None
        if self.is_main:
            try:
                with self._space_guard("commit"):
                    self._commit()
            except Exception as commit_failure:  # re-raised after the others know
                error = commit_failure
                self._abort()
        if self._any_failed(error is not None):  # the checkpoint is in place, or not
            if isinstance(error, OSError):
                raise self._fail(error, "commit") from error
            if error is not None:
                raise error
            raise self._other_rank_failed("committing")
        return False

    # -- parallel writes -------------------------------------------------------------------

    def _submit(
        self,
        name: str,
        job: Callable[[], dict[str, tuple[int, str]] | None],
        *,
        writes: bool = True,
    ) -> None:
        """Run ``job`` for file ``name`` on a writer thread (``writes``: it writes the file,
        else it only hashes files written already); it returns {file: (size, digest)} or
        None."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FILE_WRITERS, thread_name_prefix="forge-write")
        self._jobs.append((name, self._pool.submit(job)))
        if writes:
            self._written.append(name)

    def mark(self) -> int:
        """Where this rank's writes stand now, for ``files_since``."""
        return len(self._written)

    def files_since(self, mark: int) -> list[str]:
        """The files this rank has written (or handed to a writer thread) since ``mark``."""
        return sorted(self._written[mark:])

    def _finish_writes(self) -> Exception | None:
        """Wait for every write of this rank; the error to report, if one failed (a full disk
        before the others: it explains them, as they may have failed on its cleanup)."""
        errors: list[Exception] = []
        for _, future in self._jobs:
            try:
                records = future.result()
            except Exception as exc:
                errors.append(exc)
                continue
            if records:
                self._records.update(records)
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        full = [e for e in errors if isinstance(e, DiskFullError)]
        return (full or errors or [None])[0]

    def _leave_records(self) -> Exception | None:
        """A rank other than 0: its files' sizes and hashes, for rank 0's manifest."""
        if not self._records:
            return None
        name = f"{RECORDS_PREFIX}{self.rank:05d}.json"
        data = {"algorithm": self.hash_algorithm, "files": self._records}
        try:
            with self._space_guard(f"write {name} of"):
                self.storage.write_bytes(self.path / name, _dumps(data))
        except Exception as exc:
            return exc
        return None

    def _gather_records(self) -> dict[str, tuple[int, str]]:
        """Rank 0: its own records and those the other ranks left (whose files are removed);
        a record whose size is not the file's is dropped (the file is hashed again)."""
        records = dict(self._records)
        for path in sorted(self.path.glob(f"{RECORDS_PREFIX}*.json")):
            try:
                data = json.loads(path.read_text())
                if data.get("algorithm") == self.hash_algorithm:
                    records.update({n: (int(r[0]), str(r[1])) for n, r in data["files"].items()})
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                pass  # the files it names are hashed here instead
            path.unlink()
        kept = {}
        for name, (size, digest) in records.items():
            target = self.path / name
            if target.is_file() and target.stat().st_size == size:
                kept[name] = (size, digest)
        return kept

    def _abort(self, *, say: bool = False) -> None:
        """Remove the partial checkpoint; ``say`` so where no error will (a job that is
        ending): a failed save's error names the checkpoint it did not save."""
        if self.is_main and self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)
            if say:
                logger.warning("checkpoint %s was not saved", self.final_path.name)

    def _commit(self) -> None:
        if self._weights_index:
            missing = [n for n in self._weights_index if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(
                    f"checkpoint {self.final_path.name}: weight shards {missing} were not "
                    "written; the checkpoint is not saved"
                )
            write_weights_index(self.path, self._weights_index)
        self._check_hf_directory()
        recorded = self._gather_records()
        names = [n for n in list_files(self.path) if n != MANIFEST_NAME]
        for component, entry in self._components.items():
            missing = [f for f in entry["files"] if f not in names]
            if missing:
                raise CheckpointError(
                    f"checkpoint {self.final_path.name}: component '{component}' is missing "
                    f"{missing} (a rank did not write its file); the checkpoint is not saved"
                )
        unrecorded = [n for n in names if n not in recorded]
        if unrecorded:
            hashed = self.storage.hash_files(
                [self.path / n for n in unrecorded], self.hash_algorithm
            )
            recorded.update(zip(unrecorded, hashed, strict=True))
        records = [recorded[n] for n in names]
        manifest = CheckpointManifest(
            step=self.step,
            epoch=self._epoch,
            trainer=self.trainer,
            topology=self._topology,
            components=self._components,
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            metrics=self._metrics,
            files={
                n: FileEntry(size=size, **{self.hash_algorithm: digest})  # type: ignore[typeddict-item]
                for n, (size, digest) in zip(names, records, strict=True)
            },
            extra=self._extra,
        )
        self.storage.write_manifest(
            self.path / MANIFEST_NAME, _dumps(manifest.to_dict(), lenient=True)
        )
        self.storage.rename(self.path, self.final_path)
        logger.info("saved checkpoint %s", self.final_path)

    def _check_hf_directory(self) -> None:
        """A ``config.json`` claims that ``from_pretrained`` loads this directory: keep it only
        beside weights named as its architecture names them (else the directory would load
        as an untrained model); the weights stay, for forge to load by their own names."""
        if not (self.path / CONFIG_NAME).is_file():
            return
        try:
            files, _ = weight_files(self.path)
        except CheckpointError:
            return  # no weights here (a test's partial checkpoint): nothing to claim them
        problem = directory_mismatch(self.path, files)
        if problem is None:
            return
        removed = [n for n in (CONFIG_NAME, GENERATION_CONFIG_NAME) if (self.path / n).is_file()]
        for name in removed:
            (self.path / name).unlink()
        for entry in self._components.values():
            entry["files"] = [f for f in entry["files"] if f not in removed]
        logger.warning(
            "checkpoint %s is not a Hugging Face model directory (%s removed): %s. Its weights "
            "load with forge under their own names",
            self.final_path.name,
            ", ".join(removed),
            problem,
        )

    # -- writing ---------------------------------------------------------------------------

    def _target(self, name: str) -> Path:
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or name in ("", MANIFEST_NAME):
            raise ValueError(f"{name!r} is not a file name a checkpoint may hold")
        target = self.path / pure
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def save_model(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        max_shard_size: int | str = "2GB",
    ) -> None:
        """Write the model's weights (and config / tokenizer) on rank 0; other ranks return.

        ``state_dict`` (default: the model's own) holds the weights written: a save passes its
        snapshot, so the live model is never read for them. Hugging Face models use
        ``save_pretrained`` (config from ``model``); other modules are written as safetensors
        of the state dict. DDP and ``torch.compile`` wrappers are removed first.
        """
        if not self.is_main:
            return
        weights = state_dict if state_dict is not None else unwrap_model(model).state_dict()
        # into a directory of its own first: what save_pretrained wrote is then known exactly,
        # whatever other ranks and threads write into the checkpoint meanwhile
        staging = self.path / MODEL_STAGING
        try:
            with self._space_guard("write the model of", weights):
                staging.mkdir()
                self.storage.write_model(
                    staging,
                    model,
                    weights,
                    tokenizer=tokenizer,
                    max_shard_size=max_shard_size,
                )
                written = list_files(staging)
                for name in written:
                    (self.path / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staging / name, self.path / name)
                shutil.rmtree(staging)
        except OSError as exc:
            raise self._fail(exc, "write the model of") from exc
        self._written.extend(written)

        def sync_and_hash() -> dict[str, tuple[int, str]]:
            # fsynced and read back on a writer thread, while the caller goes on
            paths = [self.path / name for name in written]
            hashed = self.storage.hash_files(paths, self.hash_algorithm)
            return dict(zip(written, hashed, strict=True))

        if written:
            self._submit(written[0], sync_and_hash, writes=False)

    def _write(self, name: str, doing: str, pending: Any, write: Callable[..., Any]) -> None:
        """Hand one file to a writer thread: ``write(hash_algorithm=...)`` under the disk-full
        guard, its OSError explained."""

        def job() -> dict[str, tuple[int, str]] | None:
            try:
                with self._space_guard(doing, pending):
                    record = write(hash_algorithm=self.hash_algorithm)
            except OSError as exc:
                raise self._fail(exc, doing) from exc
            return {name: record} if record is not None else None

        self._submit(name, job)

    def save_torch(self, name: str, obj: Any) -> None:
        """``torch.save`` ``obj`` as ``name``, on the calling rank (rank 0 for shared state);
        written on a writer thread: ``obj`` must not change until the context exits."""
        target = self._target(name)
        self._write(
            name, f"write {name} of", obj, functools.partial(self.storage.write_torch, target, obj)
        )

    def save_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as JSON to ``name``, on the calling rank, in the calling thread (a
        small file: a thread would cost more than it saves)."""
        target = self._target(name)
        doing = f"write {name} of"
        try:
            with self._space_guard(doing):
                record = self.storage.write_bytes(
                    target, _dumps(obj), hash_algorithm=self.hash_algorithm
                )
        except OSError as exc:
            raise self._fail(exc, doing) from exc
        self._written.append(name)
        if record is not None:
            self._records[name] = record

    def save_safetensors(
        self, name: str, tensors: Mapping[str, torch.Tensor], *, metadata: dict | None = None
    ) -> None:
        """Write tensors as one safetensors file, on the calling rank (pipeline stages).

        Files named in ``index_weights`` get a weight index at commit, so
        ``load_model_weights`` and ``from_pretrained`` read them as one model.
        """
        target = self._target(name)
        metadata = {STEP_METADATA: str(self.step), **(metadata or {})}  # checked on validation
        write = functools.partial(self.storage.write_tensors, target, tensors, metadata)
        self._write(name, f"write {name} of", tensors, write)

    def index_weights(self, weight_files: list[str]) -> None:
        """Rank 0: at commit, index these safetensors files (written by any rank) as one model
        (``model.safetensors.index.json``); a missing one fails the save."""
        self._weights_index = list(weight_files)

    def set_components(self, *, topology: Mapping[str, Any], components: Mapping[str, Any]) -> None:
        """Rank 0: the job's topology and the components (scope, files) for the manifest."""
        self._topology = dict(topology)
        self._components = {name: dict(entry) for name, entry in components.items()}

    def set_meta(
        self,
        *,
        epoch: float | None = None,
        metrics: Mapping[str, Any] | None = None,
        world: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        """Record manifest fields (only rank 0's values are written); extra keys go top level.

        ``world`` adds to the recorded topology (e.g. the backend)."""
        clashes = set(extra) & set(CheckpointManifest(step=0).to_dict())
        if clashes:
            raise ValueError(f"set_meta: {sorted(clashes)} are manifest fields set by the writer")
        if epoch is not None:
            self._epoch = epoch
        if metrics is not None:
            self._metrics.update(metrics)
        if world is not None:
            self._topology.update(world)
        self._extra.update(extra)
