"""Which checkpoint a command means: what a user types, turned into a validated checkpoint.

Every command that reads a checkpoint asks here: ``forge resume`` (``--from``, or the run's
newest), the trainer's ``resume_from_checkpoint`` (a path, or True), a worker that torchrun
restarted, ``forge generate`` / ``evaluate`` / ``predict`` / ``export``. What may be given:

- a checkpoint directory (``.../checkpoints/checkpoint-000400``, or ``RUN/best``, the link to
  a run's best checkpoint): that checkpoint;
- a run directory (``.../run_003``) or its ``checkpoints/`` directory: its newest valid
  checkpoint, newer invalid ones skipped with a warning naming the bad file; with ``best``,
  the run's best checkpoint (``run.json``'s ``best``);
- a project directory (one with ``meta.yaml``): its newest run, as a run directory;
- for the commands that read only a model (generate, predict, export; not resume or evaluate,
  which need a run), a Hugging Face model directory that is no forge checkpoint (``config.json``
  beside the weights, no ``manifest.json``, not named ``checkpoint-N``: another tool's, or a
  forge export), or a peft adapter directory (``adapter_config.json``: a LoRA export). It has
  no manifest to check against; the weights reader checks every name against the model
  instead.

The answer is a :class:`Checkpoint` (its path and manifest) whose manifest, sizes and hashes
have been checked, once: a command hashes a checkpoint one time, and hands the
:class:`Checkpoint` on (to the trainer, to the worker it starts) rather than its path. Anything
else raises :class:`CheckpointNotFound` (or :class:`CheckpointUsageError` for options that
contradict each other) naming what was given, the path, why, and what to do.

Which run of a project is newest and which checkpoint of a run is best are known to the layer
that keeps runs (``run.json``, projects): this one asks a :class:`RunLookup` for them, the one
passed as ``runs=`` or else the one an entry point installed (``use_run_lookup``)
(:func:`use_run_lookup`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from forge.checkpoint.hf import CONFIG_NAME
from forge.checkpoint.io import ADAPTER_CONFIG, CheckpointError
from forge.checkpoint.layout import (
    MANIFEST_NAME,
    CheckpointManifest,
    inspect_checkpoint,
    latest_valid_checkpoint,
    parse_checkpoint_step,
    resume_search_dirs,
)

logger = logging.getLogger(__name__)

PROJECT_FILE = "meta.yaml"


class CheckpointNotFound(CheckpointError):
    """What was given names no valid checkpoint; the message says which path, why, and what
    to do. Nothing was changed."""


class CheckpointUsageError(CheckpointError):
    """The options given contradict what the path is (``--best`` with a checkpoint): a usage
    error, exit 2 (the CLI maps it by class name, forge.error_kinds). Nothing was changed."""


class RunLookup(Protocol):
    """What the resolver asks of the layer that keeps runs (forge.runs.PROJECT_RUNS). Each
    raises CheckpointNotFound saying why there is none."""

    def newest_run(self, project_dir: Path) -> Path:
        """A project's newest run (any config)."""

    def best_checkpoint(self, run_dir: Path) -> Path:
        """The run's best checkpoint as ``run.json`` records it (``RUN/best`` links to it)."""


_runs: RunLookup | None = None


def use_run_lookup(runs: RunLookup | None) -> RunLookup | None:
    """Make ``runs`` what a resolution without ``runs=`` asks (forge's entry points, the CLI and
    the worker each rank runs, install forge.runs' own, so the trainer's
    ``resume_from_checkpoint`` and LoRA's ``base_model`` read a project directory too); returns
    the previous one, to put back."""
    global _runs
    previous, _runs = _runs, runs
    return previous


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory whose manifest has been read and whose files were checked
    (sizes always; hashes and headers when ``hashes_verified``). ``manifest`` is None only for
    a Hugging Face model directory, which has none (``resolve_checkpoint(models=True)``)."""

    path: Path
    manifest: CheckpointManifest | None
    hashes_verified: bool = True

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest is not None else None

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)


def check_checkpoint(path: str | os.PathLike, *, verify_hashes: bool = True) -> Checkpoint:
    """``path`` as a checkpoint, validated; CheckpointNotFound lists every problem."""
    path = Path(path)
    info = inspect_checkpoint(path, verify_hashes=verify_hashes)
    if not info.valid or info.manifest is None:
        listed = "\n".join(f"  - {p}" for p in info.problems)
        raise CheckpointNotFound(f"{path} is not a valid checkpoint:\n{listed}")
    return Checkpoint(path, info.manifest, verify_hashes)


def newest_checkpoint(
    dirs: str | os.PathLike | Sequence[str | os.PathLike], *, verify_hashes: bool = True
) -> Checkpoint | None:
    """The valid checkpoint with the highest step, or None.

    ``dirs`` is a run or checkpoints directory, or several of them oldest first (the runs of
    one config): the last one holding a valid checkpoint wins. Newer invalid checkpoints are
    skipped with a warning naming the bad file; each candidate is validated once.
    """
    info = latest_valid_checkpoint(dirs, verify_hashes=verify_hashes)
    if info is None or info.manifest is None:
        return None
    return Checkpoint(info.path, info.manifest, verify_hashes)


def resolve_checkpoint(
    given: str | os.PathLike,
    *,
    best: bool = False,
    models: bool = False,
    verify_hashes: bool = True,
    runs: RunLookup | None = None,
) -> Checkpoint:
    """What a user typed where a checkpoint is expected, as a validated checkpoint.

    ``given`` is a checkpoint directory, a run directory, a run's ``checkpoints/`` directory
    or a project directory (its newest run); ``best`` asks for a run's best checkpoint;
    ``models`` also takes a Hugging Face model directory, as it is (no manifest to check).
    ``runs`` finds a project's newest run and a run's best checkpoint (None: the one installed
    with :func:`use_run_lookup`).
    """
    if isinstance(given, Checkpoint):
        if best:
            raise CheckpointUsageError(_best_of_a_checkpoint(given.path))
        return given
    path = Path(given)
    if not path.exists():
        raise CheckpointNotFound(
            f"{path}: no such checkpoint, run or project directory; give a checkpoint "
            "(RUN/checkpoints/checkpoint-N, RUN/best), a run directory (RUN) or a project"
        )
    if not path.is_dir():
        raise CheckpointNotFound(
            f"{path} is a file; give a checkpoint directory, a run directory or a project"
        )
    if _is_checkpoint(path):
        if best:
            raise CheckpointUsageError(_best_of_a_checkpoint(path))
        return check_checkpoint(path, verify_hashes=verify_hashes)
    if models and _is_model_directory(path):
        if best:
            raise CheckpointUsageError(_best_of_a_checkpoint(path))
        logger.debug("%s: a model directory, not a forge checkpoint: nothing to validate", path)
        return Checkpoint(path, None, hashes_verified=False)
    if (path / PROJECT_FILE).is_file():
        path = _run_lookup(runs, path).newest_run(path)
    if best:
        best_path = _run_lookup(runs, path).best_checkpoint(path)
        return check_checkpoint(best_path, verify_hashes=verify_hashes)
    found = newest_checkpoint(path, verify_hashes=verify_hashes)
    if found is None:
        where = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        raise CheckpointNotFound(
            f"{path}: no valid checkpoint (looked in {where}); a run saves one every "
            "save_steps, and `forge checkpoints --verify` says what is wrong with each"
        )
    return found


def resume_checkpoint(
    resume: bool | str | os.PathLike | Checkpoint | Restart | None,
    output_dir: str | os.PathLike,
    *,
    runs: RunLookup | None = None,
) -> Checkpoint | None:
    """The checkpoint a trainer's ``resume_from_checkpoint`` names, or None (start fresh).

    False / None: none. True: the newest valid checkpoint of this run, else of its sibling
    ``run_*`` directories (a warning and None when there is none). A :class:`Checkpoint`: as
    it is (validated already). A :class:`Restart`: the run's newest, else its first. A path:
    as :func:`resolve_checkpoint` reads it (no model directories: a resume needs a forge
    checkpoint); one that names no valid checkpoint raises CheckpointNotFound. ``runs`` as
    :func:`resolve_checkpoint` takes it.
    """
    if resume is None or resume is False:
        return None
    if isinstance(resume, Checkpoint):
        return resume
    if isinstance(resume, Restart):
        newest = newest_checkpoint(Path(resume.run_dir) / "checkpoints")
        return newest if newest is not None else resume.first
    if resume is True:
        dirs = resume_search_dirs(output_dir)
        found = newest_checkpoint(dirs)
        if found is None:
            logger.warning(
                "resume_from_checkpoint is set but there is no valid checkpoint in %s; "
                "training from scratch",
                ", ".join(str(d) for d in dirs),
            )
        return found
    path = Path(resume)
    if not _is_checkpoint(path):
        return resolve_checkpoint(path, runs=runs)  # a run, checkpoints or project directory
    try:
        return check_checkpoint(path)
    except CheckpointNotFound as exc:
        problems = str(exc).partition("\n")[2]
        raise CheckpointNotFound(f"cannot resume from {path}:\n{problems}") from None


@dataclass(frozen=True)
class Restart:
    """What a worker that torchrun restarted resumes from: its run's newest valid checkpoint,
    else where the first attempt started (``first``: a checkpoint, or None for the start).
    Resolved by the trainer on rank 0 like any other request, so it is hashed once."""

    run_dir: Path
    first: Checkpoint | None = None


def checked_by_launcher(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint the launching ``forge`` process resolved and hashed before it started this
    worker: its manifest and sizes are checked again (it may have changed since), its hashes
    are not (a command hashes a checkpoint once)."""
    return check_checkpoint(path, verify_hashes=False)


# ---------------------------------------------------------------------------------------------


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint directory (complete or not), as opposed to a run, checkpoints or project
    directory: it has a manifest, or a checkpoint's name."""
    return (path / MANIFEST_NAME).exists() or parse_checkpoint_step(path.resolve()) is not None


def _is_model_directory(path: Path) -> bool:
    """A Hugging Face model directory, or a peft adapter's, that is no forge checkpoint (see the
    module's text)."""
    described = (path / CONFIG_NAME).is_file() or (path / ADAPTER_CONFIG).is_file()
    return described and not _is_checkpoint(path)


def _best_of_a_checkpoint(path: Path) -> str:
    return (
        f"--best picks a run's best checkpoint, and {path} is a checkpoint; give the run "
        "directory, or drop --best"
    )


def _run_lookup(runs: RunLookup | None, path: Path) -> RunLookup:
    found = runs if runs is not None else _runs
    if found is None:
        raise CheckpointNotFound(
            f"{path}: a project's newest run and a run's best checkpoint are found by "
            "forge.runs, which this process has not installed (forge.checkpoint.resolve."
            "use_run_lookup(forge.runs.PROJECT_RUNS)); install it, or give a run or checkpoint "
            "directory"
        )
    return found
