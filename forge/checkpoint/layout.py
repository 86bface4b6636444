"""Checkpoint names, the manifest, discovery, validation and rotation."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypedDict

from forge.checkpoint.io import (
    DEFAULT_HASH,
    DELETE_PREFIX,
    HASH_ALGORITHMS,
    OLD_PREFIX,
    TEMP_PREFIX,
    WEIGHTS_INDEX_NAME,
    CheckpointError,
    hash_file,
    list_files,
    map_files,
    read_component_header,
    read_safetensors_header,
    remove_tree,
)

logger = logging.getLogger(__name__)

# 2: components with scopes and the job's topology (forge/checkpoint/registry.py);
# 1: training_state.pt + rank_state_XXXXX.pt, optimizer state keyed by parameter index.
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
CHECKPOINT_PREFIX = "checkpoint-"
# Safetensors written by the CheckpointWriter carry the step in their metadata.
STEP_METADATA = "forge_step"
SCOPES = ("shared", "stage", "sharded", "rank")
_NAME_RE = re.compile(r"checkpoint-(\d+)")
_RUN_DIR_RE = re.compile(r"run_(\d+)")
_HEX_RE = re.compile(r"[0-9a-f]+")


def checkpoint_name(step: int) -> str:
    """``checkpoint-000400``: the directory name of the checkpoint taken after ``step`` steps."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative integer (got {step!r})")
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def parse_checkpoint_step(path_or_name: str | os.PathLike) -> int | None:
    """The step of a ``checkpoint-<digits>`` name or path, or None for any other name."""
    match = _NAME_RE.fullmatch(Path(path_or_name).name)
    return int(match.group(1)) if match else None


def stage_weights_name(stage: int, num_stages: int) -> str:
    """``model-stage-00000-of-00002.safetensors``: weights of one pipeline stage."""
    return f"model-stage-{stage:05d}-of-{num_stages:05d}.safetensors"


#: safetensors metadata of a rank's rows of sharded weights: ``{name: [row offset, *shape]}``
SHARDS_METADATA = "forge_shards"


def shard_weights_name(rank: int, world_size: int) -> str:
    """``model-shard-00000-of-00002.safetensors``: one rank's rows of sharded weights."""
    return f"model-shard-{rank:05d}-of-{world_size:05d}.safetensors"


def shard_file_name(name: str, rank: int, world_size: int) -> str:
    """``optimizer-shard-00000-of-00002.pt``: one rank's shard of a sharded component."""
    return f"{name}-shard-{rank:05d}-of-{world_size:05d}.pt"


def component_file(
    name: str,
    scope: str,
    *,
    rank: int = 0,
    stage: int = 0,
    num_stages: int = 1,
    world_size: int = 1,
) -> str:
    """The torch file of component ``name`` of ``scope`` that ``rank`` (at ``stage`` of
    ``num_stages``, in a job of ``world_size``) writes: the one place these names are built."""
    if scope == "shared" or (scope == "stage" and num_stages == 1):
        return f"{name}.pt"
    if scope == "stage":
        return f"{name}-stage-{stage:05d}-of-{num_stages:05d}.pt"
    if scope == "sharded":
        return shard_file_name(name, rank, world_size)
    return f"{name}-rank-{rank:05d}.pt"


def component_file_names(
    name: str, scope: str, weights: bool, topology: dict[str, Any]
) -> list[str]:
    """The files a component of ``scope`` has in a checkpoint of ``topology``.

    Weights of a single stage, or written whole by rank 0 (scope shared: a pipeline's LoRA
    adapter, gathered from its stages), are whatever ``save_pretrained`` writes, so they are
    recorded as written and not derived here (returns []).
    """
    world = int(topology.get("world_size", 1))
    stages = int(topology.get("num_stages", 1))
    if scope == "sharded":  # every rank its own shard (one stage)
        if weights:
            return [shard_weights_name(r, world) for r in range(world)]
        return [component_file(name, scope, rank=r, world_size=world) for r in range(world)]
    if weights:
        if stages == 1 or scope == "shared":
            return []
        return [stage_weights_name(k, stages) for k in range(stages)] + [WEIGHTS_INDEX_NAME]
    if scope == "rank":
        return [component_file(name, scope, rank=r) for r in range(world)]
    if scope == "stage":
        return [component_file(name, scope, stage=k, num_stages=stages) for k in range(stages)]
    return [component_file(name, scope)]


class FileEntry(TypedDict, total=False):
    """A file's size and its digest under the one algorithm the entry names (``sha256`` in
    every checkpoint before ``xxh3_128`` existed; io.HASH_ALGORITHMS)."""

    size: int
    sha256: str
    xxh3_128: str


def file_hash(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a manifest's file entry; None unless exactly one known
    algorithm is named, with a digest of its length."""
    named = [a for a in HASH_ALGORITHMS if a in entry]
    if len(named) != 1:
        return None
    digest = entry[named[0]]
    if not isinstance(digest, str) or not _HEX_RE.fullmatch(digest):
        return None
    return (named[0], digest) if len(digest) == HASH_ALGORITHMS[named[0]] else None


def _file_entry(entry: Mapping[str, Any]) -> FileEntry:
    algorithm, digest = file_hash(entry)  # type: ignore[misc]  # checked by the parser
    return FileEntry(size=entry["size"], **{algorithm: digest})  # type: ignore[typeddict-item]


@dataclass
class CheckpointManifest:
    """What ``manifest.json`` says about a checkpoint; it is written last, once all else is."""

    step: int
    epoch: float | None = None
    trainer: str = "plain"
    created: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    topology: dict[str, Any] = field(default_factory=dict)  # world_size, num_stages, dp_size
    components: dict[str, dict[str, Any]] = field(default_factory=dict)  # scope, weights, files
    extra: dict[str, Any] = field(default_factory=dict)  # further top-level keys (set_meta)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "format_version": self.format_version,
            "step": self.step,
            "epoch": self.epoch,
            "trainer": self.trainer,
            "created": self.created,
            "metrics": self.metrics,
            "topology": self.topology,
            "components": self.components,
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
                or file_hash(entry) is None
            ):
                raise ValueError(
                    f"'files' entry {name!r} needs an integer size and one hash "
                    f"({' or '.join(HASH_ALGORITHMS)})"
                )
        for key in ("topology", "components", "metrics"):
            if not isinstance(data.get(key) or {}, dict):
                raise ValueError(f"{key!r} must be an object")
        epoch = data.get("epoch")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, (int, float))):
            raise ValueError(f"'epoch' must be a number or null (got {json.dumps(epoch)[:40]})")
        for key in ("trainer", "created"):
            if not isinstance(data.get(key, ""), str):
                raise ValueError(f"{key!r} must be a string")
        for name, entry in (data.get("components") or {}).items():
            if (
                not isinstance(entry, dict)
                or entry.get("scope") not in SCOPES
                or not isinstance(entry.get("files"), list)
                or not all(isinstance(f, str) for f in entry["files"])
            ):
                raise ValueError(
                    f"'components' entry {name!r} needs a scope ({', '.join(SCOPES)}) and a "
                    "list of files"
                )
        known = {
            "format_version",
            "step",
            "epoch",
            "trainer",
            "world",  # format 1's name for the topology
            "created",
            "metrics",
            "topology",
            "components",
        }
        return cls(
            step=data["step"],
            epoch=data.get("epoch"),
            trainer=data.get("trainer", "plain"),
            created=data.get("created", ""),
            metrics=dict(data.get("metrics") or {}),
            files={k: _file_entry(v) for k, v in files.items()},
            format_version=data["format_version"],
            topology=dict(data.get("topology") or data.get("world") or {}),
            components={k: dict(v) for k, v in (data.get("components") or {}).items()},
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
    ``verify_hashes``), that no unlisted file is present, and that every component has the
    files its scope needs in the manifest's topology (a shard per stage, a file per rank).
    With ``verify_hashes`` it also reads the header each state file carries (component, step,
    rank, stage; without the tensors) and the step in each safetensors file's metadata, so a
    file from another checkpoint, rank or stage, or one carrying pickled code, is found before
    anything is loaded, even when the manifest lists its hash.
    """
    return _inspect(Path(path), verify_hashes)[1]


def inspect_checkpoint(path: str | os.PathLike, *, verify_hashes: bool = True) -> CheckpointInfo:
    """One checkpoint directory, its manifest and its problems (``validate_checkpoint``'s)."""
    path = Path(path)
    manifest, problems = _inspect(path, verify_hashes)
    step = manifest.step if manifest is not None else parse_checkpoint_step(path)
    return CheckpointInfo(path, -1 if step is None else step, not problems, problems, manifest)


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
            algorithm, expected = file_hash(manifest.files[name]) or (DEFAULT_HASH, "")
            try:
                # sha256 with one argument, as before (tests count the files hashed through it)
                digest = (
                    hash_file(path / name)
                    if algorithm == DEFAULT_HASH
                    else hash_file(path / name, algorithm)
                )
            except OSError as exc:
                return f"{name}: unreadable ({exc.strerror or exc})"
            return None if digest == expected else f"{name}: {algorithm} mismatch"

        problems.extend(p for p in map_files(check, to_hash) if p)
        if not problems:
            problems.extend(_header_problems(path, manifest))

    problems.extend(_component_problems(manifest))
    listed = set(manifest.files) | {MANIFEST_NAME}
    for name in list_files(path):
        if name not in listed:
            problems.append(f"{name}: present but not in the manifest (an extra or stray file)")
    return manifest, problems


def _component_problems(manifest: CheckpointManifest) -> list[str]:
    """Files the components need, by the manifest's own topology, that it does not list."""
    problems = []
    topology = manifest.topology
    for field_name in ("world_size", "num_stages"):
        value = topology.get(field_name, 1)
        if manifest.components and (not isinstance(value, int) or value < 1):
            problems.append(f"{MANIFEST_NAME}: topology {field_name} {value!r} is not a count")
            return problems
    for name, entry in sorted(manifest.components.items()):
        expected = component_file_names(name, entry["scope"], bool(entry.get("weights")), topology)
        if expected and sorted(entry["files"]) != sorted(expected):
            problems.append(
                f"component '{name}' ({entry['scope']}): files {sorted(entry['files'])} do not "
                f"match its topology (world_size {topology.get('world_size', 1)}, num_stages "
                f"{topology.get('num_stages', 1)}), which needs {sorted(expected)}"
            )
        if entry.get("weights") and not entry["files"]:
            problems.append(f"component '{name}': no weight files recorded")
        for file in entry["files"]:
            if file not in manifest.files:
                problems.append(f"{file}: component '{name}' needs it, not in the manifest")
    return problems


def _header_problems(path: Path, manifest: CheckpointManifest) -> list[str]:
    """Files whose own header names another step, component, rank or stage than the manifest
    gives them, or that cannot be read safely. Only called once sizes and hashes match."""
    problems = []
    for name in sorted(manifest.files):
        if name.endswith(".safetensors"):
            problem = _safetensors_step_problem(path / name, manifest.step)
            if problem:
                problems.append(f"{name}: {problem}")
    if not manifest.components or _component_problems(manifest):
        return problems  # format 1, or a manifest whose components are already wrong
    for component, entry in sorted(manifest.components.items()):
        if entry.get("weights"):
            continue
        for name, expect in _expected_headers(component, entry["scope"], manifest):
            try:
                header = read_component_header(path / name)
            except CheckpointError as exc:
                problems.append(f"{name}: {str(exc).removeprefix(f'{path / name}: ')}")
                continue
            wrong = {k: v for k, v in expect.items() if header.get(k) != v}
            if wrong:
                detail = ", ".join(
                    f"{k} {header.get(k)!r} (expected {v!r})" for k, v in wrong.items()
                )
                problems.append(
                    f"{name}: written for another checkpoint, rank or stage: its header says "
                    f"{detail}"
                )
    return problems


def _expected_headers(
    component: str, scope: str, manifest: CheckpointManifest
) -> list[tuple[str, dict[str, Any]]]:
    """(file, the header fields it must carry) for each file of a component."""
    topology = manifest.topology
    files = component_file_names(component, scope, False, topology)
    base = {"name": component, "step": manifest.step}
    if scope in ("rank", "sharded"):
        return [(f, {**base, "rank": r}) for r, f in enumerate(files)]
    if scope == "stage" and len(files) > 1:
        stages = int(topology.get("num_stages", 1))
        return [(f, {**base, "stage": k, "num_stages": stages}) for k, f in enumerate(files)]
    return [(f, base) for f in files]


def _safetensors_step_problem(file: Path, step: int) -> str | None:
    try:
        metadata = read_safetensors_header(file).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError, struct.error) as exc:
        return f"not a readable safetensors file ({exc})"
    saved = metadata.get(STEP_METADATA) if isinstance(metadata, dict) else None
    if saved is not None and saved != str(step):
        return f"written at step {saved}, not {step}: a file from another checkpoint"
    return None


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


def find_leftovers(checkpoints_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """What interrupted saves and deletions left in a checkpoints (or run) directory, with
    what each is. Discovery never takes them; the next save removes them (sweep_temp_dirs)."""
    directory = _checkpoints_dir(checkpoints_dir)
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = {e.name for e in entries}
    found = []
    for entry in entries:
        name = entry.name
        if not name.startswith(TEMP_PREFIX):
            continue
        if name.startswith(OLD_PREFIX):
            if name[len(OLD_PREFIX) :] not in names:
                continue  # discovery takes it under its own name
            what = "the old copy of a checkpoint a save of the same step replaced"
        elif name.startswith(DELETE_PREFIX):
            what = "a checkpoint whose deletion (rotation) was interrupted"
        elif parse_checkpoint_step(name[len(TEMP_PREFIX) :]) is not None:
            what = "a save that did not finish"
        else:
            what = "a temporary file"
        found.append((Path(entry.path), what))
    return found


def _summary(problems: list[str], limit: int = 3) -> str:
    shown = "; ".join(problems[:limit])
    return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


def latest_valid_checkpoint(
    dirs: str | os.PathLike | Sequence[str | os.PathLike], *, verify_hashes: bool = True
) -> CheckpointInfo | None:
    """The valid checkpoint with the highest step (validated once, manifest read), or None.

    ``dirs`` is a checkpoints (or run) directory, or several of them oldest first (the runs of
    one config): the last one holding a valid checkpoint wins. Newer invalid checkpoints are
    skipped with a warning naming the bad file.
    """
    if isinstance(dirs, (str, os.PathLike)):
        dirs = [dirs]
    for directory in reversed(list(dirs)):
        for _, path in reversed(_checkpoint_dirs(directory)):
            info = inspect_checkpoint(path, verify_hashes=verify_hashes)
            if info.valid:
                return info
            logger.warning(
                "skipping %s: %s (in %s)", path.name, _summary(info.problems), path.parent
            )
    return None


def find_latest_checkpoint(
    dirs: str | os.PathLike | Sequence[str | os.PathLike], *, verify_hashes: bool = True
) -> Path | None:
    """The path of :func:`latest_valid_checkpoint`, or None."""
    info = latest_valid_checkpoint(dirs, verify_hashes=verify_hashes)
    return info.path if info is not None else None


def resume_search_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Where ``resume_from_checkpoint: true`` looks: sibling ``run_*`` directories'
    checkpoints, oldest run first, then this run's own (which wins when it has a valid one)."""
    out = Path(output_dir)
    own = out / "checkpoints"
    if not _RUN_DIR_RE.fullmatch(out.name) or not out.parent.is_dir():
        return [own]
    runs = sorted(
        (p for p in out.parent.iterdir() if p.is_dir() and _RUN_DIR_RE.fullmatch(p.name)),
        key=lambda p: int(_RUN_DIR_RE.fullmatch(p.name).group(1)),
    )
    return [run / "checkpoints" for run in runs if run.name != out.name] + [own]


# ---------------------------------------------------------------------------------------------
# rotation and cleanup


def best_checkpoints(
    checkpoints_dir: str | os.PathLike,
    metric: str | None,
    greater_is_better: bool,
    k: int,
) -> list[Path]:
    """The ``k`` checkpoints whose manifests record the best finite ``metric``, best first
    (ties: the earlier step). Read from the manifests on disk, so a resumed run and
    ``forge checkpoints`` rank them as the run that saved them did."""
    if metric is None or k < 1:
        return []
    ranked = []
    for step, path in _checkpoint_dirs(checkpoints_dir):
        try:
            value = read_manifest(path).metrics.get(metric)
        except (OSError, ValueError, KeyError, CheckpointError):
            continue  # incomplete or damaged: never a best one
        if isinstance(value, (int, float)) and math.isfinite(value):
            ranked.append((-value if greater_is_better else value, step, path))
    return [path for _, _, path in sorted(ranked)[:k]]


def rollback_anchors(
    checkpoints_dir: str | os.PathLike, step: int, anchor_before: int
) -> list[Path]:
    """The checkpoints a rollback asked at ``step`` or later may restore: the newest complete
    one at least ``anchor_before`` steps before ``step`` (sizes checked, not hashes) and every
    later one (each is the anchor of a later step), oldest first."""
    found = _checkpoint_dirs(checkpoints_dir)
    first = 0
    for i in reversed(range(len(found))):
        at, path = found[i]
        if at <= step - anchor_before and not validate_checkpoint(path, verify_hashes=False):
            first = i
            break
    return [path for _, path in found[first:]]


def kept_reasons(
    checkpoints_dir: str | os.PathLike,
    metric: str | None = None,
    greater_is_better: bool = False,
    k: int = 1,
    anchor_before: int | None = None,
) -> dict[Path, str]:
    """Why rotation keeps each checkpoint it must keep: ``last`` (the newest), ``best i of k``
    (by ``metric`` in the manifests), ``rollback anchor`` (with ``anchor_before``: those a
    divergence detector may still roll back to, ``rollback_anchors`` at the newest one's step).
    Checkpoints not named are the ones it may delete."""
    reasons: dict[Path, list[str]] = {}
    found = _checkpoint_dirs(checkpoints_dir)
    if found:
        reasons.setdefault(found[-1][1], []).append("last")
    for rank, path in enumerate(best_checkpoints(checkpoints_dir, metric, greater_is_better, k)):
        reasons.setdefault(path, []).append(f"best {rank + 1} of {k}")
    if found and anchor_before is not None:
        for path in rollback_anchors(checkpoints_dir, found[-1][0], anchor_before):
            reasons.setdefault(path, []).append("rollback anchor")
    return {path: ", ".join(why) for path, why in reasons.items()}


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
