"""Checkpoint names, the manifest, discovery, validation and rotation."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypedDict

from forge.checkpoint.io import (
    OLD_PREFIX,
    TEMP_PREFIX,
    CheckpointError,
    hash_file,
    map_files,
    remove_tree,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TRAINING_STATE_NAME = "training_state.pt"
CHECKPOINT_PREFIX = "checkpoint-"
_NAME_RE = re.compile(r"checkpoint-(\d+)")
_RANK_STATE_RE = re.compile(r"rank_state_(\d+)\.pt")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def checkpoint_name(step: int) -> str:
    """``checkpoint-000400``: the directory name of the checkpoint taken after ``step`` steps."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative integer (got {step!r})")
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def parse_checkpoint_step(path_or_name: str | os.PathLike) -> int | None:
    """The step of a ``checkpoint-<digits>`` name or path, or None for any other name."""
    match = _NAME_RE.fullmatch(Path(path_or_name).name)
    return int(match.group(1)) if match else None


def rank_state_name(rank: int) -> str:
    """``rank_state_00001.pt``: the per-rank state file (rng, data position) of one rank."""
    return f"rank_state_{rank:05d}.pt"


def stage_weights_name(stage: int, num_stages: int) -> str:
    """``model-stage-00000-of-00002.safetensors``: weights of one pipeline stage."""
    return f"model-stage-{stage:05d}-of-{num_stages:05d}.safetensors"


class FileEntry(TypedDict):
    size: int
    sha256: str


@dataclass
class CheckpointManifest:
    """What ``manifest.json`` says about a checkpoint; it is written last, once all else is."""

    step: int
    epoch: float | None = None
    trainer: str = "plain"
    world: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # further top-level keys (set_meta)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "format_version": self.format_version,
            "step": self.step,
            "epoch": self.epoch,
            "trainer": self.trainer,
            "world": self.world,
            "created": self.created,
            "metrics": self.metrics,
            "files": self.files,
        }
        clashes = set(self.extra) & set(data)
        if clashes:
            raise ValueError(f"manifest extra keys clash with standard keys: {sorted(clashes)}")
        return {**data, **self.extra}

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointManifest:
        """Parse and type-check the JSON object; ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        for key in ("format_version", "step", "files"):
            if key not in data:
                raise ValueError(f"no {key!r}")
        if not isinstance(data["format_version"], int) or not isinstance(data["step"], int):
            raise ValueError("'format_version' and 'step' must be integers")
        files = data["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' must be an object")
        for name, entry in files.items():
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("size"), int)
                or not _SHA256_RE.fullmatch(str(entry.get("sha256")))
            ):
                raise ValueError(f"'files' entry {name!r} needs an integer size and a sha256")
        known = {"format_version", "step", "epoch", "trainer", "world", "created", "metrics"}
        return cls(
            step=data["step"],
            epoch=data.get("epoch"),
            trainer=data.get("trainer", "plain"),
            world=dict(data.get("world") or {}),
            created=data.get("created", ""),
            metrics=dict(data.get("metrics") or {}),
            files={k: FileEntry(size=v["size"], sha256=v["sha256"]) for k, v in files.items()},
            format_version=data["format_version"],
            extra={k: v for k, v in data.items() if k not in known | {"files"}},
        )


def _load_manifest(manifest_path: Path) -> CheckpointManifest:
    """Parse a manifest file; ValueError gives the reason it cannot be used."""
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError("missing (checkpoint incomplete)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"unreadable ({exc})") from exc
    try:
        return CheckpointManifest.from_dict(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"corrupt ({exc})") from exc


def read_manifest(path: str | os.PathLike) -> CheckpointManifest:
    """Read a checkpoint directory's (or a given) ``manifest.json``; CheckpointError if bad."""
    path = Path(path)
    manifest_path = path / MANIFEST_NAME if path.is_dir() else path
    try:
        return _load_manifest(manifest_path)
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: {exc}") from exc


@dataclass
class CheckpointInfo:
    """One checkpoint directory found on disk and whether it can be trusted."""

    path: Path
    step: int
    valid: bool
    problems: list[str]
    manifest: CheckpointManifest | None


# ---------------------------------------------------------------------------------------------
# validation


def _unsafe_name(name: str) -> bool:
    pure = PurePosixPath(name)
    return pure.is_absolute() or ".." in pure.parts or name in ("", MANIFEST_NAME)


def validate_checkpoint(path: str | os.PathLike, *, verify_hashes: bool = True) -> list[str]:
    """Problems that make a checkpoint untrustworthy, each naming its file; [] when valid.

    Checks the manifest, that every listed file exists with the listed size (and sha256 when
    ``verify_hashes``), and that per-rank state exists for every rank of the world.
    """
    return _inspect(Path(path), verify_hashes)[1]


def _inspect(path: Path, verify_hashes: bool) -> tuple[CheckpointManifest | None, list[str]]:
    """A checkpoint's manifest (None if unusable) and its problems."""
    if not path.is_dir():
        return None, [f"{path.name}: not a directory"]
    try:
        manifest = _load_manifest(path / MANIFEST_NAME)
    except ValueError as exc:
        return None, [f"{MANIFEST_NAME}: {exc}"]
    problems = []
    if manifest.format_version > FORMAT_VERSION:
        problems.append(
            f"{MANIFEST_NAME}: format_version {manifest.format_version} is newer than this "
            f"forge reads ({FORMAT_VERSION}); upgrade forge"
        )
    step = parse_checkpoint_step(path.name.removeprefix(OLD_PREFIX))
    if step is not None and step != manifest.step:
        problems.append(f"{MANIFEST_NAME}: step {manifest.step} does not match {path.name}")

    to_hash = []
    for name, entry in sorted(manifest.files.items()):
        if _unsafe_name(name):
            problems.append(f"{name}: not a plain file name inside the checkpoint")
            continue
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name}: listed in manifest but missing")
            continue
        except OSError as exc:
            problems.append(f"{name}: unreadable ({exc.strerror or exc})")
            continue
        if size != entry["size"]:
            problems.append(f"{name}: size {size} bytes, manifest says {entry['size']}")
        elif verify_hashes:
            to_hash.append(name)
    if to_hash:

        def check(name: str) -> str | None:
            try:
                digest = hash_file(path / name)
            except OSError as exc:
                return f"{name}: unreadable ({exc.strerror or exc})"
            return None if digest == manifest.files[name]["sha256"] else f"{name}: sha256 mismatch"

        problems.extend(p for p in map_files(check, to_hash) if p)

    world_size = manifest.world.get("world_size")
    rank_files = {n for n in manifest.files if _RANK_STATE_RE.fullmatch(n)}
    if rank_files and isinstance(world_size, int):
        for rank in range(world_size):
            name = rank_state_name(rank)
            if name not in rank_files:
                problems.append(f"{name}: not in manifest (world_size {world_size})")
    return manifest, problems


# ---------------------------------------------------------------------------------------------
# discovery


def _checkpoints_dir(directory: str | os.PathLike) -> Path:
    """Accept a run directory for its ``checkpoints/`` subdirectory."""
    directory = Path(directory)
    nested = directory / "checkpoints"
    return nested if nested.is_dir() else directory


def _checkpoint_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``checkpoint-<digits>`` subdirectories as (step, path), oldest first.

    A ``.tmp-old-checkpoint-<digits>`` directory counts under that name when the name itself is
    absent: a save of the same step was killed between moving it aside and replacing it.
    """
    directory = _checkpoints_dir(directory)
    try:
        entries = [e for e in os.scandir(directory) if e.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = {e.name for e in entries}
    found = []
    for entry in entries:
        name = entry.name
        if name.startswith(OLD_PREFIX) and name[len(OLD_PREFIX) :] not in names:
            name = name[len(OLD_PREFIX) :]
        step = parse_checkpoint_step(name)
        if step is not None:
            found.append((step, Path(entry.path)))
    return sorted(found, key=lambda item: (item[0], item[1].name))


def find_checkpoints(
    checkpoints_dir: str | os.PathLike, *, verify_hashes: bool = True
) -> list[CheckpointInfo]:
    """Every checkpoint in a directory (or a run directory), validated, oldest first."""
    infos = []
    for step, path in _checkpoint_dirs(checkpoints_dir):
        manifest, problems = _inspect(path, verify_hashes)
        infos.append(CheckpointInfo(path, step, not problems, problems, manifest))
    return infos


def _summary(problems: list[str], limit: int = 3) -> str:
    shown = "; ".join(problems[:limit])
    return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


def find_latest_checkpoint(
    dirs: str | os.PathLike | Sequence[str | os.PathLike], *, verify_hashes: bool = True
) -> Path | None:
    """The valid checkpoint with the highest step, or None.

    ``dirs`` is a checkpoints (or run) directory, or several of them oldest first (the runs of
    one config): the last one holding a valid checkpoint wins. Newer invalid checkpoints are
    skipped with a warning naming the bad file.
    """
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    for directory in reversed(list(dirs)):
        for _, path in reversed(_checkpoint_dirs(directory)):
            problems = validate_checkpoint(path, verify_hashes=verify_hashes)
            if not problems:
                return path
            logger.warning("skipping %s: %s (in %s)", path.name, _summary(problems), path.parent)
    return None


# ---------------------------------------------------------------------------------------------
# rotation and cleanup


def rotate_checkpoints(
    checkpoints_dir: str | os.PathLike,
    save_total_limit: int | None,
    *,
    protect: Iterable[str | os.PathLike] = (),
) -> list[Path]:
    """Delete the oldest checkpoints so at most ``save_total_limit`` remain; return them.

    Never deletes a protected checkpoint (the best), the newest one, nor the newest one whose
    files are all present, so more than the limit may remain.
    """
    if save_total_limit is None:
        return []
    if isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int):
        raise ValueError(
            f"save_total_limit must be a positive integer or None (got {save_total_limit!r})"
        )
    if save_total_limit < 1:
        raise ValueError(
            f"save_total_limit must be a positive integer or None (got {save_total_limit})"
        )
    checkpoints = [path for _, path in _checkpoint_dirs(checkpoints_dir)]
    if len(checkpoints) <= save_total_limit:
        return []
    keep = {Path(p).resolve() for p in protect}
    keep.add(checkpoints[-1].resolve())
    for path in reversed(checkpoints):
        if not validate_checkpoint(path, verify_hashes=False):
            keep.add(path.resolve())
            break
    excess = len(checkpoints) - save_total_limit
    deleted = []
    for path in checkpoints:
        if excess <= 0:
            break
        if path.resolve() in keep:
            continue
        try:
            remove_tree(path)
        except OSError as exc:
            logger.warning("could not delete old checkpoint %s: %s", path, exc)
            continue
        logger.info("deleted old checkpoint %s (save_total_limit %d)", path.name, save_total_limit)
        deleted.append(path)
        excess -= 1
    return deleted


def sweep_temp_dirs(checkpoints_dir: Path) -> None:
    """Remove what killed writers left behind (``.tmp-*``), restoring a moved-aside checkpoint.

    A checkpoint is moved to ``.tmp-old-<name>`` only while a new one of the same step replaces
    it; if the kill came between the two renames the old one is intact and gets its name back.
    """
    for entry in list(os.scandir(checkpoints_dir)):
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        path = Path(entry.path)
        if entry.name.startswith(OLD_PREFIX) and entry.is_dir(follow_symlinks=False):
            final = path.with_name(entry.name[len(OLD_PREFIX) :])
            if (
                parse_checkpoint_step(final) is not None
                and not final.exists()
                and not validate_checkpoint(path, verify_hashes=False)
            ):
                os.rename(path, final)
                logger.warning("restored %s, which an interrupted save had moved aside", final.name)
                continue
        logger.info("removing stale temporary %s", path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
