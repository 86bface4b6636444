"""A run directory opened for reading: its record, where it stands, and every checkpoint in it.

``RunReader(run_dir)`` reads what ``forge runs`` and ``forge checkpoints`` print: the run's
summary (``summary()``: config, status, step, checkpoints on disk, best, created, stream
position) and its checkpoints (``checkpoints(verify=...)``: each with its step, size, whether it
is valid and why not, and why rotation keeps it), with what interrupted saves left behind
(``leftovers()``). Nothing needs a valid checkpoint, so a run killed before its first save, or
whose every checkpoint is damaged, is read too. A ``CheckpointReader`` (forge.read.reader) of
one of its checkpoints reads the run through its ``run``, a ``RunReader``.

No torch is imported: listing runs stays fast.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.runs import RunError, RunRecord

if TYPE_CHECKING:
    from forge.config import Config, Project

__all__ = ["CheckpointEntry", "RunReader", "RunSummary"]


@dataclass(frozen=True)
class RunSummary:
    """Where a run stands. ``status`` is run.json's, except ``killed`` for a run whose record
    says running that no process holds; ``best`` is ``(metric, value)`` or None."""

    config: str
    status: str
    step: int
    checkpoints: int
    best: tuple[str, float] | None
    created: str
    stream: str  # the stream position ("" for a map-style dataset)


@dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint of a run, or (``leftover``) what an interrupted save or deletion left."""

    path: Path
    step: int | None
    epoch: float | None
    size: int  # bytes on disk
    kept: str  # why rotation keeps it ("last", "best 1 of 1", ...), "" when it may delete it
    problems: Sequence[str] = ()  # why it is not valid (empty: valid)
    leftover: str = ""  # what a leftover is ("a save that did not finish", ...)

    @property
    def valid(self) -> bool:
        return not self.leftover and not self.problems


class RunReader:
    """A run directory (``run.json``, ``config.yaml``, ``checkpoints/``) opened for reading.

    ``allow``: more module roots the run's config may call (as ``--allow``). Reading its
    ``record`` raises ``RunError`` when ``run.json`` is missing or damaged."""

    def __init__(self, run_dir: str | os.PathLike, *, allow: Sequence[str] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.allow = list(allow)

    def __repr__(self) -> str:
        return f"RunReader({str(self.run_dir)!r})"

    @functools.cached_property
    def record(self) -> dict[str, Any]:
        """The run's ``run.json`` as written."""
        return RunRecord.load(self.run_dir).data

    @functools.cached_property
    def project(self) -> Project:
        """The project the run belongs to (run.json's, else the one holding its output/)."""
        from forge.config import load_project

        return load_project(Path(self.record.get("project") or self.run_dir.parents[2]))

    @functools.cached_property
    def config(self) -> Config:
        """The config the run trained with (its ``config.yaml``, parsed and checked: a
        ``ConfigError`` lists every problem)."""
        from forge.launch.worker import load_run_config

        return load_run_config(self.run_dir, self.project, self.allow)

    def summary(self) -> RunSummary:
        """Where the run stands, its record caught up with its committed checkpoints (a run
        killed between a commit and its record); ``RunError`` for a damaged record."""
        from forge.runs import (
            checkpoint_count,
            current_record,
            newest_step,
            run_is_live,
            stream_position_text,
        )

        data = current_record(self.run_dir).data
        status = data.get("status", "?")
        if status == "running" and not run_is_live(self.run_dir):
            status = "killed"  # its record says running, but no process holds the run
        best = data.get("best") or {}
        value = best.get("value")
        return RunSummary(
            config=data.get("config", "?"),
            status=status,
            step=newest_step(self.run_dir, data),
            checkpoints=checkpoint_count(self.run_dir),
            best=(best["metric"], value)
            if best.get("metric") and isinstance(value, (int, float))
            else None,
            created=data.get("created", ""),
            stream=stream_position_text(data),
        )

    def checkpoints(self, *, verify: bool = False) -> list[CheckpointEntry]:
        """Every checkpoint of the run, oldest first, validated (sizes; hashes too with
        ``verify``), with why rotation keeps it."""
        from forge.checkpoint.layout import find_checkpoints

        kept = self._kept_reasons()
        entries = []
        for info in find_checkpoints(self.run_dir / "checkpoints", verify_hashes=verify):
            entries.append(
                CheckpointEntry(
                    path=info.path,
                    step=info.step,
                    epoch=info.manifest.epoch if info.manifest else None,
                    size=_tree_bytes(info.path),
                    kept=kept.get(info.path, ""),
                    problems=tuple(info.problems),
                )
            )
        return entries

    def leftovers(self) -> list[CheckpointEntry]:
        """What interrupted saves and deletions left in ``checkpoints/`` (never loaded; the
        next save removes them), or, while the run trains, the save being written."""
        from forge.checkpoint.layout import find_leftovers

        return [
            CheckpointEntry(path, None, None, _tree_bytes(path), "", leftover=what)
            for path, what in find_leftovers(self.run_dir / "checkpoints")
        ]

    @property
    def is_live(self) -> bool:
        """Whether a process is training the run now."""
        from forge.runs import run_is_live

        return run_is_live(self.run_dir)

    def _kept_reasons(self) -> dict[Path, str]:
        """Why rotation keeps each checkpoint (forge.checkpoint.layout.kept_reasons), ranked
        as run.json's ``best`` entry says."""
        from forge.checkpoint.layout import kept_reasons

        try:
            data = self.record
        except RunError:
            data = {}  # summary() reports a damaged record
        best = data.get("best") or {}
        top_k = best.get("top_k", 1)
        anchor_before = data.get("rollback_anchor_before")
        return kept_reasons(
            self.run_dir / "checkpoints",
            best.get("metric"),
            bool(best.get("greater_is_better", False)),
            top_k if isinstance(top_k, int) else 1,
            anchor_before=anchor_before if isinstance(anchor_before, int) else None,
        )


def _tree_bytes(path: Path) -> int:
    """The bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for file in path.rglob("*"):
        try:
            total += file.stat().st_size if file.is_file() else 0
        except OSError:  # removed while we looked (a live run's rotation)
            continue
    return total
