"""Low-level checkpoint I/O: durable writes, hashing, directory commit, writing model weights,
and safe reading of torch files and safetensors headers.

Everything here is independent of the checkpoint layout; ``layout``, ``writer`` and ``weights``
(the one reader of model weights) build on it.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import logging
import os
import pickle
import re
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.checkpoint.hf import is_hf_model
from forge.wrappers import unwrap_model

if TYPE_CHECKING:  # torch is imported where used, so discovery and validation load without it
    import torch
    from torch import nn

# Temporary names in a checkpoints directory all start with this prefix, so discovery never
# mistakes them for checkpoints and a later writer can sweep what a killed run left behind
# (``.tmp-old-*``, a complete checkpoint moved aside during a replacement, is the exception).
TEMP_PREFIX = ".tmp-"
OLD_PREFIX = TEMP_PREFIX + "old-"
DELETE_PREFIX = TEMP_PREFIX + "delete-"

# The weights of a checkpoint as Hugging Face lays them out: one file, or shards with an index
# (the pipeline trainer writes one shard per stage, all named in the index).
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a peft adapter's (LoRA), as peft names them
ADAPTER_CONFIG = "adapter_config.json"

# Every component .pt file is {HEADER_KEY: {name, scope, step, rank, stage, ...}, "state": ...}
# (registry.py), so validation can tell a file of another checkpoint, rank or stage.
HEADER_KEY = "forge_component"

_CHUNK_BYTES = 4 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or trusted; the message names the file."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be written because its filesystem ran out of space."""


def os_error_message(exc: OSError, what: str) -> str:
    """A one-line explanation of an OSError raised while writing ``what``."""
    reason = exc.strerror or str(exc)
    code = errno.errorcode.get(exc.errno or 0, "")
    message = f"{what}: {reason}" + (f" [{code}]" if code else "")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message += "; free disk space or lower save_total_limit"
    return message


# ---------------------------------------------------------------------------------------------
# durability


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(
    path: Path, data: bytes, hash_algorithm: str | None = None
) -> tuple[int, str] | None:
    """Write ``data`` to ``path`` and fsync it (no rename; the directory is still temporary).
    With ``hash_algorithm``, returns the file's (size, hex digest), hashed from ``data``."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if hash_algorithm is None:
        return None
    digest = new_digest(hash_algorithm)
    digest.update(data)
    return len(data), digest.hexdigest()


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f"{path.name}.tmp")
    write_file_durably(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON next to ``path`` and rename it into place, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# The integrity hashes a manifest may name, each with the length of its hex digest. sha256
# is what every forge checkpoint had until xxh3_128 (xxhash: about 19 GB/s on one core here
# against sha256's 1.7; it detects corruption and truncation, not tampering, which no hash in
# the manifest stops anyway) became the default; a manifest names its algorithm in each
# file's entry, so checkpoints of either kind verify.
HASH_ALGORITHMS = {"sha256": 64, "xxh3_128": 32}
DEFAULT_HASH = "xxh3_128"


def new_digest(algorithm: str = DEFAULT_HASH) -> Any:
    """A hashlib-like object of ``algorithm`` (one of HASH_ALGORITHMS)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown checkpoint hash {algorithm!r}; use one of {list(HASH_ALGORITHMS)}")


def _read_into(f: Any, digest: Any) -> int:
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    while n := f.readinto(buffer):
        digest.update(view[:n])
        size += n
    return size


class HashingFile:
    """A binary file that hashes every byte written through it: the digest of a file is
    computed while it is written, in the same pass over memory, instead of reading it back.

    ``record()`` gives (size, hex digest) once writing is done. ``torch.save`` accepts it as
    its file (it only calls ``write`` and ``flush``).
    """

    def __init__(self, file: Any, algorithm: str = DEFAULT_HASH) -> None:
        self._file = file
        self._digest = new_digest(algorithm)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if not view.c_contiguous or view.format != "B":
            view = view.cast("B") if view.c_contiguous else memoryview(bytes(view))
        self._digest.update(view)
        self._file.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._file.flush()

    def record(self) -> tuple[int, str]:
        return self.size, self._digest.hexdigest()


def sync_and_hash(path: Path, algorithm: str = DEFAULT_HASH) -> tuple[int, str]:
    """fsync a file and return its (size in bytes, hex digest), reading it in chunks."""
    digest = new_digest(algorithm)
    with open(path, "rb", buffering=0) as f:
        os.fsync(f.fileno())
        size = _read_into(f, digest)
    return size, digest.hexdigest()


def hash_file(path: Path, algorithm: str = DEFAULT_HASH) -> str:
    """Hex digest of a file (sha256 unless told), read in chunks."""
    digest = new_digest(algorithm)
    with open(path, "rb", buffering=0) as f:
        _read_into(f, digest)
    return digest.hexdigest()


def map_files(fn: Any, paths: list[Path]) -> list[Any]:
    """Apply ``fn`` to every path, a few at a time (hashlib releases the GIL on large reads)."""
    if len(paths) <= 1:
        return [fn(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(4, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, paths))


def list_files(root: Path) -> list[str]:
    """Every regular file under ``root`` as a sorted relative POSIX path."""
    found = []
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            found.append((Path(dirpath) / filename).relative_to(root).as_posix())
    return sorted(found)


def fsync_tree_dirs(root: Path) -> None:
    """fsync ``root`` and every directory below it, deepest first."""
    for dirpath, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        fsync_dir(Path(dirpath))


def commit_directory(tmp: Path, final: Path) -> None:
    """Rename a complete temporary directory to its final name, replacing any old one.

    Linux cannot rename onto a non-empty directory, so an existing ``final`` is moved aside
    to ``.tmp-old-<name>`` first; a writer that finds that name without ``final`` restores it.
    """
    parent = final.parent
    if not final.exists():
        os.rename(tmp, final)
        fsync_dir(parent)
        return
    old = parent / f"{OLD_PREFIX}{final.name}"
    if old.exists():
        shutil.rmtree(old)
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        os.rename(old, final)  # put the previous checkpoint back under its name
        raise
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_tree(path: Path) -> Path:
    """Delete a directory so that no half-deleted tree ever keeps its name.

    It is renamed to a temporary name first (atomic), then removed; a kill during the removal
    leaves only a ``.tmp-delete-*`` directory, which the next writer sweeps away.
    """
    doomed = path.parent / f"{DELETE_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------------------------------------
# running out of space

# A filesystem with less than this free after a failed write counts as full: a write that runs
# out of space fills the disk up to its last block before it fails.
_NEARLY_FULL_BYTES = 1024 * 1024
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# The same errors once a library has turned them into text (safetensors' Rust I/O errors).
_NO_SPACE_TEXT = re.compile(
    r"no space left on device|disk quota exceeded|"
    + "|".join(rf"os error {code}\b" for code in sorted(_NO_SPACE_ERRNOS)),
    re.IGNORECASE,
)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes this user may still write on the filesystem of ``path`` (or its nearest parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def directory_bytes(path: str | os.PathLike) -> int:
    """Total size of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for filename in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, filename)).st_size
            except OSError:
                continue
    return total


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (a module, or nested dicts / lists), shared ones once."""
    import torch
    from torch import nn

    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.device.type == "meta":
                continue
            try:
                storage = item.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                key = (id(item), 0)
            if key not in seen:
                seen.add(key)
                total += item.numel() * item.element_size()
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _failure_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_write_failure(exc: BaseException) -> bool:
    # torch.save to a path raises RuntimeError("[enforce fail at inline_container.cc:...]
    # unexpected pos ...") and safetensors a SafetensorError: neither keeps the errno.
    return isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError"


def is_disk_full(exc: BaseException, directory: str | os.PathLike) -> bool:
    """Whether ``exc``, raised while writing into ``directory``, means its disk is full.

    True for ENOSPC / EDQUOT anywhere in the exception's chain, for their text in a library's
    message, and for an I/O failure that left the filesystem with (almost) no free space.
    Call it before removing what the failed write left, which may be what filled the disk.
    """
    chain = list(_failure_chain(exc))
    for failure in chain:
        if isinstance(failure, OSError) and failure.errno in _NO_SPACE_ERRNOS:
            return True
        if _NO_SPACE_TEXT.search(str(failure)):
            return True
    if not any(_is_write_failure(failure) for failure in chain):
        return False
    try:
        return free_bytes(directory) < _NEARLY_FULL_BYTES
    except OSError:
        return False


def format_bytes(n: int) -> str:
    """``1.5 MiB``: a byte count for people."""
    if n < 1024:
        return f"{n} bytes"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def estimate_checkpoint_bytes(
    partial: Path, *, written: int = 0, pending: Any = None, previous: Path | None = None
) -> tuple[int, str]:
    """How many bytes a checkpoint being written needs, and what the estimate rests on.

    ``partial`` is the temporary checkpoint, ``written`` the bytes its files held before the
    write that failed began, ``pending`` what that write was saving and ``previous`` the newest
    earlier checkpoint. The previous checkpoint's size is the better estimate when there is
    one: it holds every file this checkpoint will (optimizer state, tokenizer, per-rank state),
    while at a failure only the files so far and the object being saved are known. Without
    one, or when they already exceed it, the estimate is ``written`` plus the tensor bytes of
    ``pending`` (or what ``partial`` holds now, if more).
    """
    known = max(directory_bytes(partial), written + tensor_bytes(pending))
    previous_bytes = directory_bytes(previous) if previous is not None else 0
    if previous is not None and previous_bytes >= known:
        return previous_bytes, f"the size of the previous checkpoint {previous.name}"
    return known, "the files written so far plus the tensors being saved"


@contextmanager
def disk_full_guard(
    what: str,
    directory: str | os.PathLike,
    *,
    needed: Callable[[], tuple[int, str]],
    cleanup: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Turn every way a write into ``directory`` fails for lack of space into one DiskFullError.

    ``what`` completes "could not ..." (``"write optimizer.pt of checkpoint ..."``).
    ``needed`` gives (bytes the checkpoint needs, what that estimate rests on), e.g.
    ``estimate_checkpoint_bytes``; ``cleanup`` removes the partial checkpoint. Both run only
    after a failure, ``needed`` first, so it can count what the failed write left. Any other
    exception passes through unchanged.
    """
    try:
        yield
    except CheckpointError:
        raise  # already explained (a guard around a guard)
    except Exception as exc:
        if not is_disk_full(exc, directory):
            raise
        need, basis = needed()
        removed = ""
        if cleanup is not None:
            try:
                cleanup()
                removed = " The partial checkpoint was removed; earlier checkpoints are untouched."
            except OSError as cleanup_error:
                removed = f" The partial checkpoint could not be removed ({cleanup_error})."
        free = free_bytes(directory)
        raise DiskFullError(
            f"disk full: could not {what}: the checkpoint needs about {format_bytes(need)} "
            f"({basis}) and {format_bytes(free)} is free on the filesystem of {directory}. "
            "Free disk space there, or lower save_total_limit to keep fewer checkpoints." + removed
        ) from exc


# ---------------------------------------------------------------------------------------------
# model weights


@contextmanager
def quiet_hub_saves() -> Iterator[None]:
    """No "Model weights successfully saved to <temporary directory>" from huggingface_hub."""
    from huggingface_hub.serialization import _torch as hub_torch

    hub_logger = getattr(hub_torch, "logger", None)  # named by its file, outside the hub's tree
    if not isinstance(hub_logger, logging.Logger):
        yield
        return
    level = hub_logger.level
    hub_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


@contextmanager
def no_hf_progress_bars() -> Iterator[None]:
    """No "Writing model shards" bars in the middle of the training progress output."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def save_model_weights(
    model: nn.Module,
    directory: Path,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    max_shard_size: int | str = "2GB",
) -> None:
    """Write a model's weights (and config, for Hugging Face models) as safetensors.

    Hugging Face models go through ``save_pretrained`` so ``from_pretrained`` can load the
    directory; any other module (a wrapper too, whatever attributes it carries) is written as
    its state dict under its own names and without ``config.json``, sharded with an index when
    it is larger than ``max_shard_size``, with shared (tied) tensors stored once. ``state_dict``
    (default: the model's own) is what gets written, e.g. one gathered from sharded ranks.
    """
    model = unwrap_model(model)
    if is_hf_model(model):
        kwargs: dict[str, Any] = {"max_shard_size": max_shard_size}
        if state_dict is not None:
            kwargs["state_dict"] = dict(state_dict)
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
            kwargs["safe_serialization"] = True  # transformers 4.x; 5.x only writes safetensors
        with no_hf_progress_bars():
            model.save_pretrained(directory, **kwargs)
        return
    from huggingface_hub import save_torch_state_dict

    source = model.state_dict() if state_dict is None else state_dict
    state_dict = {k: v.detach() for k, v in source.items()}
    with quiet_hub_saves():
        save_torch_state_dict(
            state_dict, directory, max_shard_size=max_shard_size, metadata={"format": "pt"}
        )


def save_tensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict | None,
    hash_algorithm: str | None = None,
) -> tuple[int, str] | None:
    """Write one safetensors file, fsynced; tensors that share storage are stored as separate
    copies. With ``hash_algorithm``, returns the file's (size, hex digest)."""
    from safetensors.torch import save

    seen: set[tuple[int, int]] = set()
    prepared = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.device.index or 0)
        if tensor.numel() and key in seen:
            tensor = tensor.clone()
        seen.add(key)
        prepared[name] = tensor.contiguous().cpu()
    data = save(prepared, metadata={"format": "pt", **(metadata or {})})
    return write_file_durably(path, data, hash_algorithm)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor names, dtypes, offsets), without the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > os.fstat(f.fileno()).st_size - 8:  # a damaged file: never read 2**64 bytes
            raise ValueError(f"{path.name}: header length {length} exceeds the file")
        return json.loads(f.read(length))


def write_weights_index(directory: Path, weight_files: Iterable[str]) -> None:
    """Write ``model.safetensors.index.json`` for weight files written separately (per stage)."""
    weight_map: dict[str, str] = {}
    total = 0
    for filename in weight_files:
        header = read_safetensors_header(directory / filename)
        for name, info in header.items():
            if name == "__metadata__" or name in weight_map:
                continue
            weight_map[name] = filename
            start, end = info["data_offsets"]
            total += end - start
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_file_durably(directory / WEIGHTS_INDEX_NAME, json.dumps(index, indent=2).encode())


# ---------------------------------------------------------------------------------------------
# safe reading of torch files


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_OPERAND_RE = re.compile(r"Unsupported operand (\d+)")


def _refusal_reason(message: str) -> str:
    if match := _GLOBAL_RE.search(message):
        return f"unsupported global {match.group(1)}"
    if match := _OPERAND_RE.search(message):
        return f"unsupported pickle opcode {match.group(1)}"
    return message.strip().splitlines()[0][:200] if message.strip() else "rejected by weights_only"


def load_torch_state(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """``torch.load`` a checkpoint file to CPU with ``weights_only=True``.

    A file holding anything besides tensors and plain data (a pickled function or class) is
    refused with a CheckpointError, as is a missing or corrupt file. ``mmap`` maps the tensors
    instead of reading them (for a look at the plain data around them).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        import torch

        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refusing to load: it holds Python objects other than tensors and plain "
            f"data ({_refusal_reason(str(exc))}); a checkpoint can never run code. "
            "Was it written by forge?"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().split(". ")[0] or type(exc).__name__
        raise CheckpointError(f"{path}: unreadable, corrupt or truncated ({first})") from exc


def read_component_header(path: str | os.PathLike) -> dict[str, Any]:
    """The header a component file carries (component, step, rank, stage), its tensors mapped
    rather than read; CheckpointError for a file that is not a safe forge component file."""
    payload = load_torch_state(path, mmap=True)
    header = payload.get(HEADER_KEY) if isinstance(payload, dict) else None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a forge component file (no {HEADER_KEY} header)")
    return header


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files holding a checkpoint's weights, and aliases of shared tensors."""
    index_path = directory / WEIGHTS_INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            names = sorted(set(index["weight_map"].values()))
            metadata = index.get("metadata") or {}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index_path}: unreadable weight index ({exc})") from exc
        if any(Path(name).name != name for name in names):
            raise CheckpointError(f"{index_path}: weight files must be plain names in {directory}")
        files = [directory / name for name in names]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in {index_path.name} but missing")
        return files, {k: v for k, v in metadata.items() if isinstance(v, str)}
    if (directory / WEIGHTS_NAME).is_file():
        return [directory / WEIGHTS_NAME], {}
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{directory}: no model weights ({WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME} "
            "or model-*.safetensors)"
        )
    return files, {}
