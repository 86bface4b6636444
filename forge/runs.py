"""Run directories: ``<project>/output/<config>/run_NNN/`` and their ``run.json`` record.

A run holds the rendered config exactly as trained (``config.yaml``), a ``run.json`` record
(number, config, overrides, host, versions, status, checkpoint history, best), the metrics
log, TensorBoard events, the checkpoints, and ``best``: a link to the best checkpoint (by
``metric_for_best_model``), kept current at every save. Nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_PATTERN = re.compile(r"^run_(\d{3,})$")
BEST_LINK = "best"
STATUSES = ("created", "running", "completed", "failed", "interrupted")


class RunError(Exception):
    """A run directory is missing or cannot be used; the message says which and why."""


def now_iso() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def config_output_dir(output_root: Path, config_name: str) -> Path:
    """``output/<config>`` for a config name such as ``train.yaml`` or ``sub/x.yaml``."""
    stem = config_name[:-5] if config_name.endswith(".yaml") else config_name
    return output_root / stem


def run_number(run_dir: Path) -> int | None:
    match = RUN_PATTERN.match(Path(run_dir).name)
    return int(match.group(1)) if match else None


def list_run_dirs(config_dir: Path) -> list[Path]:
    """Runs of one config, oldest first."""
    if not config_dir.is_dir():
        return []
    runs = [p for p in config_dir.iterdir() if p.is_dir() and run_number(p) is not None]
    return sorted(runs, key=lambda p: run_number(p) or 0)


def all_run_dirs(output_root: Path) -> list[Path]:
    """Every run of a project (any config), by creation time, oldest first."""
    if not output_root.is_dir():
        return []
    found = [p.parent for p in output_root.rglob("run_*/run.json") if run_number(p.parent)]
    return sorted(found, key=lambda p: (RunRecord.load(p).data.get("created_ns", 0), str(p)))


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


def package_versions() -> dict[str, str]:
    from importlib import metadata

    from forge.envinfo import PACKAGES

    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_commit(directory: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=5,
    )
    return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


@dataclass
class RunRecord:
    """The ``run.json`` of one run; every write is atomic."""

    run_dir: Path
    data: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.run_dir / "run.json"

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        path = Path(run_dir) / "run.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as err:
            raise RunError(f"{path}: missing; {run_dir} is not a forge run directory") from err
        except json.JSONDecodeError as err:
            raise RunError(f"{path}: not valid JSON ({err})") from err
        return cls(Path(run_dir), data)

    def save(self) -> None:
        write_json_atomic(self.path, self.data)

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.data["updated"] = now_iso()
        self.save()

    def set_status(self, status: str, **fields: Any) -> None:
        assert status in STATUSES, status
        self.update(status=status, **fields)

    def add_checkpoint(
        self, path: Path, step: int, metrics: dict[str, Any], best: dict[str, Any] | None
    ) -> None:
        entry = {
            "step": step,
            "path": os.path.relpath(path, self.run_dir),
            "metrics": metrics,
            "saved": now_iso(),
        }
        history = [c for c in self.data.get("checkpoints", []) if c.get("step") != step]
        for previous in history:  # rotation (save_total_limit) may have removed some
            if not (self.run_dir / previous["path"]).exists():
                previous["deleted"] = True
        history.append(entry)
        self.data["checkpoints"] = sorted(history, key=lambda c: c["step"])
        self.data["step"] = step
        if best:
            self.data["best"] = best
            link_best_checkpoint(self.run_dir, self.run_dir / best["checkpoint"])
        self.update()


def link_best_checkpoint(run_dir: Path, checkpoint: Path) -> None:
    """Point ``RUN/best`` at ``checkpoint`` (a relative symlink, replaced atomically)."""
    link = Path(run_dir) / BEST_LINK
    target = os.path.relpath(checkpoint, run_dir)
    if link.is_symlink() and os.readlink(link) == target:
        return
    staging = link.with_name(f".{BEST_LINK}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    try:
        os.symlink(target, staging)
        os.replace(staging, link)
    except OSError:  # a filesystem without symlinks: run.json's "best" still names it
        staging.unlink(missing_ok=True)


def best_checkpoint(run_dir: Path) -> Path:
    """The run's best checkpoint (``run.json``'s ``best``, which ``RUN/best`` links to).

    Raises RunError saying why when the run has none.
    """
    record = RunRecord.load(run_dir)
    best = record.data.get("best") or {}
    if not best.get("checkpoint"):
        raise RunError(
            f"{run_dir} has no best checkpoint: no checkpoint was saved with the metric "
            "metric_for_best_model names (set metric_for_best_model and evaluate where you save)"
        )
    path = (Path(run_dir) / best["checkpoint"]).resolve()
    if not path.is_dir():
        raise RunError(f"{run_dir}: the best checkpoint {path} is missing")
    return path


def create_run(
    config_dir: Path,
    *,
    config_name: str,
    config_text: str,
    project_root: Path,
    overrides: list[str],
    variables: dict[str, Any],
    nproc: int,
) -> Path:
    """Create the next ``run_NNN`` under ``config_dir`` with its config and record.

    Numbers are claimed with an exclusive ``mkdir``, so two launches at once get two runs.
    """
    config_dir.mkdir(parents=True, exist_ok=True)
    existing = [run_number(p) or 0 for p in list_run_dirs(config_dir)]
    number = max(existing, default=0) + 1
    while True:
        run_dir = config_dir / f"run_{number:03d}"
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            number += 1
    (run_dir / "config.yaml").write_text(config_text)
    record = RunRecord(
        run_dir,
        {
            "run": number,
            "config": config_name,
            "project": str(project_root),
            "overrides": list(overrides),
            "variables": {k: _jsonable(v) for k, v in variables.items()},
            "created": now_iso(),
            "created_ns": time.time_ns(),
            "updated": now_iso(),
            "host": socket.gethostname(),
            "command": sys.argv,
            "git_commit": git_commit(project_root),
            "versions": package_versions(),
            "world_size": nproc,
            "status": "created",
            "step": 0,
            "checkpoints": [],
            "best": None,
            "resumes": [],
        },
    )
    record.save()
    return run_dir


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def find_run(
    output_root: Path,
    *,
    number: int | None = None,
    run_dir: Path | None = None,
    config_name: str | None = None,
) -> Path:
    """The run to resume: an explicit dir, run ``number`` (of ``config_name`` if given), or
    the newest run of the project."""
    if run_dir is not None:
        run_dir = Path(run_dir).resolve()
        if not (run_dir / "run.json").is_file():
            raise RunError(f"{run_dir} is not a forge run directory (no run.json)")
        return run_dir
    if config_name is not None:
        candidates = list_run_dirs(config_output_dir(output_root, config_name))
    else:
        candidates = all_run_dirs(output_root)
    if number is not None:
        matching = [p for p in candidates if run_number(p) == number]
        if not matching:
            names = ", ".join(str(p.relative_to(output_root)) for p in candidates) or "none"
            raise RunError(f"no run number {number} under {output_root} (runs: {names})")
        if len(matching) > 1:
            names = ", ".join(str(p.relative_to(output_root)) for p in matching)
            raise RunError(
                f"run number {number} exists for several configs ({names}); "
                "add --config NAME or use --run-dir DIR"
            )
        return matching[0]
    if not candidates:
        raise RunError(f"no runs under {output_root}; start one with `forge train CONFIG`")
    return candidates[-1]


def discard_unstarted_run(run_dir: Path) -> bool:
    """Remove a run that a config error stopped before it wrote anything but its record.

    Returns True if the run directory was removed.
    """
    if not {p.name for p in run_dir.iterdir()} <= {"config.yaml", "run.json"}:
        return False
    for path in run_dir.iterdir():
        path.unlink()
    run_dir.rmdir()
    return True


# --------------------------------------------------------------------------- resume


def find_resume_checkpoint(run_dir: Path, from_checkpoint: Path | None = None) -> Path:
    """The checkpoint a resume starts from: ``from_checkpoint`` if valid, else the run's newest
    valid one. Raises RunError (nothing changed) when there is none."""
    from forge.checkpoint.layout import find_latest_checkpoint, validate_checkpoint

    if from_checkpoint is not None:
        checkpoint = Path(from_checkpoint).resolve()
        problems = validate_checkpoint(checkpoint)
        if problems:
            raise RunError(f"cannot resume from {checkpoint}:\n  " + "\n  ".join(problems))
        return checkpoint
    checkpoint = find_latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise RunError(
            f"{run_dir} has no valid checkpoint to resume from; nothing was changed. "
            "Start a new run with `forge train`, or pass --from CKPT."
        )
    return checkpoint


def apply_config_overrides(
    run_dir: Path, project: Any, overrides: list[str], allow: list[str] = ()
) -> None:
    """Apply ``--set`` overrides to a run's ``config.yaml`` (checked first; ConfigError lists
    every problem and leaves the file as it was)."""
    from forge.config import ConfigError, parse_config

    if not overrides:
        return
    config_path = run_dir / "config.yaml"
    cfg = parse_config(
        config_path.read_text(),
        project=project,
        overrides=list(overrides),
        allow=list(allow),
        origin=str(config_path),
    )
    problems = cfg.check()
    if problems:
        raise ConfigError(problems, config=str(config_path))
    config_path.write_text(cfg.text)


def record_resume(
    run_dir: Path, checkpoint: Path, *, overrides: list[str], world_size: int
) -> None:
    """Append this resume (when, from which checkpoint, overrides, world size) to run.json."""
    record = RunRecord.load(run_dir)
    resumes = record.data.get("resumes", [])
    resumes.append(
        {
            "at": now_iso(),
            "from": str(checkpoint),
            "overrides": list(overrides),
            "world_size": world_size,
        }
    )
    record.update(resumes=resumes)
