"""Run directories: ``<project>/output/<config>/run_NNN/`` and their ``run.json`` record.

A run holds the rendered config exactly as trained (``config.yaml``), a ``run.json`` record
(number, config, overrides, host, versions, status, checkpoint history, best, resumes,
restarts), the metrics log, TensorBoard events, the checkpoints, and ``best``: a link to the
best checkpoint (by ``metric_for_best_model``), kept current at every save. While a run
trains, two lock files in its directory say so (:class:`RunLock`); nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.checkpoint.io import write_json_atomic
from forge.checkpoint.resolve import CheckpointNotFound

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: runs are not locked
    fcntl = None  # type: ignore[assignment]

RUN_PATTERN = re.compile(r"^run_(\d{3,})$")
BEST_LINK = "best"
# pruned: a sweep trial its study stopped early (forge.sweep), with a checkpoint at that step;
# diverged: a divergence detector stopped it (forge.train.divergence), with a checkpoint too
STATUSES = (
    "created",
    "running",
    "completed",
    "failed",
    "interrupted",
    "killed",
    "pruned",
    "diverged",
)
#: the exit code of a run a divergence detector stopped (not 0, 1, 2, 130 or 143)
EXIT_DIVERGED = 3


class RunError(Exception):
    """A run directory is missing or cannot be used; the message says which and why."""


class AmbiguousRunError(RunError):
    """A run number that several configs have, given without saying which: the user's to fix
    (exit 2; forge.error_kinds)."""


class RunBusyError(RunError):
    """The run is being trained by live processes; resuming it now would train it twice."""


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
    return sorted(found, key=lambda p: (_created_ns(p), str(p)))


def _created_ns(run_dir: Path) -> int:
    try:
        return RunRecord.load(run_dir).data.get("created_ns", 0)
    except RunError:
        return 0  # a damaged record sorts first; `forge runs` reports it


# what run.json records the versions of, and `forge env` prints
PACKAGES = (
    "forge",
    "torch",
    "transformers",
    "accelerate",
    "torchdata",
    "tokenizers",
    "safetensors",
    "peft",
    "jinja2",
    "pyyaml",
    "tqdm",
    "tensorboard",
    "numpy",
)


def package_versions() -> dict[str, str]:
    from importlib import metadata

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


_DAMAGED = "the run record is damaged: restore it from a backup or correct it by hand"

# The fields of run.json that forge reads, and the types they must have when present.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "run": (int,),
    "config": (str,),
    "status": (str,),
    "step": (int,),
    "world_size": (int,),
    "created": (str,),
    "created_ns": (int,),
    "checkpoints": (list,),
    "best": (dict, type(None)),
    "resumes": (list,),
    "restarts": (list,),
    "signal": (str, type(None)),
    "reached_step": (int,),
    "sweep": (dict,),
}
_TYPE_NAMES = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def record_problem(data: Any) -> str | None:
    """What makes a parsed ``run.json`` unusable (a wrong type where forge reads it), or None."""
    if not isinstance(data, dict):
        return f"must be a JSON object (got {type(data).__name__})"
    for key, types in _FIELD_TYPES.items():
        if key not in data:
            continue
        value = data[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = " or ".join(_TYPE_NAMES.get(t, "null") for t in types)
            return f"'{key}' must be {wanted} (got {json.dumps(value)[:60]})"
    if "status" in data and data["status"] not in STATUSES:
        return f"'status' must be one of {', '.join(STATUSES)} (got {data['status']!r:.60})"
    if "signal" in data and data["signal"] is not None:
        import signal as _signal

        if data["signal"] not in _signal.Signals.__members__:
            return f"'signal' must name a signal such as SIGTERM (got {data['signal']!r:.60})"
    for index, entry in enumerate(data.get("checkpoints", [])):
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("path"), str)
            or type(entry.get("step")) is not int
        ):
            return f"'checkpoints' entry {index} must be an object with a 'path' and a 'step'"
    for key in ("resumes", "restarts"):
        if not all(isinstance(entry, dict) for entry in data.get(key, [])):
            return f"'{key}' must be a list of objects"
    return None


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
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RunError(f"{path}: not valid JSON ({err}); {_DAMAGED}") from err
        except OSError as err:
            raise RunError(f"{path}: unreadable ({err.strerror or err})") from err
        problem = record_problem(data)
        if problem:
            raise RunError(f"{path}: {problem}; {_DAMAGED}")
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
        self,
        path: Path,
        step: int,
        metrics: dict[str, Any],
        best: dict[str, Any] | None,
        *,
        data: dict[str, int] | None = None,
    ) -> None:
        """Record a committed checkpoint; ``data``: a training stream's position in it
        (``{"epoch", "shards", "items"}`` of rank 0), which ``forge runs`` shows."""
        self._record_checkpoint(path, step, metrics, best, data=data)
        self.update()

    def _record_checkpoint(
        self,
        path: Path,
        step: int,
        metrics: dict[str, Any],
        best: dict[str, Any] | None,
        *,
        saved: str | None = None,
        link: bool = True,
        data: dict[str, int] | None = None,
    ) -> None:
        """Add checkpoint ``path`` of ``step`` to the history (in memory); ``best`` becomes
        the run's best, and ``link`` points ``RUN/best`` at it."""
        entry = {
            "step": step,
            "path": os.path.relpath(path, self.run_dir),
            "metrics": metrics,
            "saved": saved or now_iso(),
        }
        if data:
            entry["data"] = dict(data)
        history = [c for c in self.data.get("checkpoints", []) if c.get("step") != step]
        for previous in history:  # rotation (save_total_limit) may have removed some
            if not (self.run_dir / previous["path"]).exists():
                previous["deleted"] = True
        history.append(entry)
        self.data["checkpoints"] = sorted(history, key=lambda c: c["step"])
        self.data["step"] = step
        if data:
            self.data["stream_position"] = dict(data)
        if best:
            self.data["best"] = best
            if link:
                link_best_checkpoint(self.run_dir, self.run_dir / best["checkpoint"])


def current_record(run_dir: Path, *, repair: bool = True) -> RunRecord:
    """``run.json`` caught up with the run's committed checkpoints.

    A checkpoint's manifest is committed before run.json records it, so a run killed between
    the two has a record that lags its checkpoints: its step, history and best come here from
    the manifests of the checkpoints it does not record (each names the run's best as of its
    commit). With ``repair``, a run no process is training gets the caught-up run.json and
    ``RUN/best`` written back; a live run's own next update records them.
    """
    record = RunRecord.load(run_dir)
    step = int(record.data.get("step") or 0)
    recorded = {entry["step"] for entry in record.data.get("checkpoints", [])}
    newer = [
        (path, manifest)
        for path, manifest in committed_manifests(run_dir)
        if manifest.step > step and manifest.step not in recorded
    ]
    if not newer:
        return record
    write = repair and not run_is_live(run_dir)
    for path, manifest in newer:
        best = manifest_best(Path(run_dir), path, manifest.extra.get("best"))
        record._record_checkpoint(
            path, manifest.step, dict(manifest.metrics), best, saved=manifest.created, link=write
        )
    if write:
        record.update()
    return record


def committed_manifests(run_dir: Path) -> list[tuple[Path, Any]]:
    """(path, manifest) of every checkpoint of the run whose commit completed (its manifest
    and files are in place; hashes are not read), oldest first."""
    from forge.checkpoint.layout import find_checkpoints

    found = find_checkpoints(Path(run_dir) / "checkpoints", verify_hashes=False)
    return [(info.path, info.manifest) for info in found if info.valid and info.manifest]


def manifest_best(run_dir: Path, checkpoint: Path, best: Any) -> dict[str, Any] | None:
    """run.json's ``best`` from a manifest's (which names a sibling of ``checkpoint``), or None
    where the manifest records none or its best is gone."""
    if not isinstance(best, dict) or not isinstance(best.get("checkpoint"), str):
        return None
    path = Path(checkpoint).parent / Path(best["checkpoint"]).name
    if not path.is_dir():
        return None
    return {
        "checkpoint": os.path.relpath(path, run_dir),
        "metric": best.get("metric"),
        "value": best.get("value"),
    }


def stream_position_text(data: dict[str, Any]) -> str:
    """A run's stream position, as ``forge runs`` shows it ("" for a map-style dataset)."""
    position = data.get("stream_position")
    if not isinstance(position, dict):
        return ""
    return (
        f"epoch {position.get('epoch', '?')}, {position.get('shards', '?')} shard(s), "
        f"{position.get('items', '?')} item(s)"
    )


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
    """The run's best checkpoint (``run.json``'s ``best``, which ``RUN/best`` links to, caught
    up with the committed checkpoints: :func:`current_record`).

    Raises RunError saying why when the run has none.
    """
    record = current_record(run_dir)
    best = record.data.get("best") or {}
    if not best.get("checkpoint"):
        raise RunError(
            f"{run_dir} has no best checkpoint: no checkpoint was saved with the metric "
            "metric_for_best_model names (set metric_for_best_model and evaluate where you save)"
        )
    path = (Path(run_dir) / best["checkpoint"]).resolve()
    if not path.is_dir():
        raise RunError(
            f"{run_dir}: its best checkpoint {path} is missing (deleted by hand?); give another "
            "checkpoint of the run, or the run without --best for its newest"
        )
    return path


class ProjectRuns:
    """A project's newest run and a run's best checkpoint, as forge.checkpoint.resolve asks for
    them (its ``RunLookup``): that layer knows checkpoints, not ``run.json`` or projects."""

    def newest_run(self, project_dir: Path) -> Path:
        """A project's newest run (any config)."""
        from forge.config import load_project

        output = load_project(project_dir.resolve()).output_dir
        runs = all_run_dirs(output)
        if not runs:
            raise CheckpointNotFound(
                f"{project_dir}: the project has no runs under {output}; train one with "
                f"`forge train -p {project_dir}`, or give a run or checkpoint directory"
            )
        return runs[-1]

    def best_checkpoint(self, run_dir: Path) -> Path:
        """The run's best checkpoint as ``run.json`` records it (``RUN/best`` links to it)."""
        try:
            return best_checkpoint(run_dir)
        except RunError as exc:
            raise CheckpointNotFound(f"--best: {exc}") from None


PROJECT_RUNS = ProjectRuns()


def create_run(
    config_dir: Path,
    *,
    config_name: str,
    config_text: str,
    project_root: Path,
    overrides: list[str],
    variables: dict[str, Any],
    nproc: int,
    fields: dict[str, Any] | None = None,
) -> Path:
    """Create the next ``run_NNN`` under ``config_dir`` with its config and record; ``fields``
    adds to the record (a sweep trial's ``sweep``).

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
            "variables": {k: jsonable(v) for k, v in variables.items()},
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
            **(fields or {}),
        },
    )
    record.save()
    return run_dir


def jsonable(value: Any) -> Any:
    """``value`` if JSON can write it, else its ``str``."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


#: how `forge resume` names one of several runs with the same number
CHOOSE_BY_CONFIG = "add --config NAME or use --run-dir DIR"


def find_run(
    output_root: Path,
    *,
    number: int | None = None,
    run_dir: Path | None = None,
    config_name: str | None = None,
    choose: Any = CHOOSE_BY_CONFIG,
) -> Path:
    """The run to resume: an explicit dir, run ``number`` (of ``config_name`` if given), or
    the newest run of the project.

    A ``number`` that several configs' runs have is an AmbiguousRunError whose fix is
    ``choose``: the text, or a function of the matching run directories that gives it (each
    command names the options it takes)."""
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
            fix = choose(matching) if callable(choose) else choose
            raise AmbiguousRunError(
                f"run number {number} exists for several configs ({names}); {fix}"
            )
        return matching[0]
    if not candidates:
        raise RunError(f"no runs under {output_root}; start one with `forge train CONFIG`")
    return candidates[-1]


def discard_unstarted_run(run_dir: Path) -> bool:
    """Remove a run that a config error stopped before it trained a step or wrote anything
    but its record.

    A run whose record says it trained (``reached_step``), saved a checkpoint (its trainer's
    ``output_dir`` may lie outside the run), resumed or restarted, or that ended any other way
    than failing (a run still marked running was not recorded by its rank 0) is kept, as is
    one whose record cannot be read. Returns True if the run directory was removed.
    """
    if not {p.name for p in run_dir.iterdir()} <= {"config.yaml", "run.json", *LOCK_NAMES}:
        return False
    try:
        data = RunRecord.load(run_dir).data
    except RunError:
        return False
    if (
        data.get("status") not in ("created", "failed")
        or data.get("reached_step", 0) != 0
        or data.get("step", 0) != 0
        or any(data.get(key) for key in ("checkpoints", "resumes", "restarts", "best"))
    ):
        return False
    for path in run_dir.iterdir():
        path.unlink()
    run_dir.rmdir()
    return True


# --------------------------------------------------------------------------- the run lock

# Two flock'd files say who is training a run. The launcher (`forge train` / `forge resume`)
# holds LAUNCH_LOCK from before it starts any process until they have all ended; rank 0 of the
# training processes holds TRAIN_LOCK while it trains, which covers training processes that
# outlive a killed launcher. The kernel releases a flock when its holder dies, so a killed
# run never leaves a lock behind; the holder's pid in the file only names it in messages.
LAUNCH_LOCK = ".lock"
TRAIN_LOCK = ".lock-train"
LOCK_NAMES = (LAUNCH_LOCK, TRAIN_LOCK)
_CLAIM_WAIT_S = 1.0  # a lock another command only probes is free again within milliseconds


class RunLock:
    """An exclusive ``flock`` on a file in a run directory, held until :meth:`release` or the
    holder's death."""

    def __init__(self, path: Path, handle: Any) -> None:
        self.path = path
        self._handle = handle

    @classmethod
    def acquire(
        cls, run_dir: Path, name: str, *, wait: float = _CLAIM_WAIT_S, sign: bool = True
    ) -> RunLock:
        """Take the lock ``name`` of ``run_dir``, trying for ``wait`` seconds; RunBusyError
        names the live holder if it stays taken. ``sign`` writes this process's pid into the
        file, for messages."""
        path = Path(run_dir) / name
        try:
            handle = open(path, "a+")  # held open as long as the lock
        except OSError as err:
            message = f"{path}: cannot open the run's lock file ({err.strerror or err})"
            raise RunError(message) from err
        if not _flock(handle, exclusive=True, wait=wait):
            holder = _holder_text(path)
            handle.close()
            raise RunBusyError(_busy_message(Path(run_dir), holder))
        if sign:
            handle.seek(0)
            handle.truncate()
            json.dump(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}, handle
            )
            handle.flush()
        return cls(path, handle)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases the flock
            self._handle = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _flock(handle: Any, *, exclusive: bool, wait: float) -> bool:
    if fcntl is None:
        return True
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(handle.fileno(), mode)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def lock_signer(run_dir: Path, name: str) -> int | None:
    """The pid the holder of lock ``name`` of ``run_dir`` wrote into it (``sign``); None where
    the file names none."""
    try:
        return int(json.loads((Path(run_dir) / name).read_text() or "{}")["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _holder_text(path: Path) -> str:
    try:
        holder = json.loads(path.read_text() or "{}")
        signed = f"pid {int(holder['pid'])} on {holder['host']}, since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return _still_holding(path, None) or "another process"
    if holder["host"] == socket.gethostname() and not _pid_alive(int(holder["pid"])):
        # the signer died; what holds the lock is a process it started (it inherited the file)
        others = _still_holding(path, int(holder["pid"]))
        if others:
            return f"{signed}, which has died; still running: {others}"
    return signed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _still_holding(path: Path, signer: int | None) -> str | None:
    """The live processes of this machine that have ``path`` open (Linux: /proc), with their
    command lines, or None where that cannot be read."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    target, found = str(path.resolve()), []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), signer):
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                found.append(f"pid {entry.name} ({command[:80] or '?'})")
        except OSError:
            continue
    return "; ".join(found[:4]) or None


def _busy_message(run_dir: Path, holder: str) -> str:
    return (
        f"{run_dir.name} is being trained right now ({holder}); resuming it would train it "
        "twice. Wait for it to end, or stop it (kill -TERM PID saves a checkpoint first) "
        f"and resume then. ({run_dir})"
    )


def claim_run(run_dir: Path) -> RunLock:
    """The launch lock of ``run_dir`` for a command about to train it; RunBusyError when the
    run is being trained by a live launcher or by training processes whose launcher died."""
    launch = RunLock.acquire(run_dir, LAUNCH_LOCK)
    try:
        RunLock.acquire(run_dir, TRAIN_LOCK, sign=False).release()  # a probe: rank 0 takes it
    except RunBusyError:
        launch.release()
        raise
    return launch


def hold_training_lock(run_dir: Path, *, wait: float = 60.0) -> RunLock:
    """Rank 0's lock while it trains. After an elastic restart the previous rank 0 may still be
    exiting, hence the wait."""
    return RunLock.acquire(run_dir, TRAIN_LOCK, wait=wait)


def run_is_live(run_dir: Path) -> bool:
    """Whether a live process holds either lock of ``run_dir`` (a shared probe, so it never
    stops a claimant for longer than the probe)."""
    if fcntl is None:
        return False
    for name in LOCK_NAMES:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        with contextlib.suppress(OSError), open(path) as handle:
            if not _flock(handle, exclusive=False, wait=0.0):
                return True
    return False


def stale_running_note(run_dir: Path) -> str | None:
    """For a run whose record says 'running' though nothing holds its locks: what happened."""
    try:
        data = RunRecord.load(run_dir).data
    except RunError:
        return None
    if data.get("status") != "running" or run_is_live(run_dir):
        return None
    holder = _holder_text(Path(run_dir) / TRAIN_LOCK)
    return (
        f"{Path(run_dir).name} was left 'running' by a process that is gone ({holder}): "
        "it was killed or crashed"
    )


# --------------------------------------------------------------------------- resume


def resume_command(run_dir: Path, project_root: Path) -> str:
    """The command that continues ``run_dir``, with paths as short as the working directory allows."""

    def shown(path: Path) -> str:
        relative = os.path.relpath(path)
        return shlex.quote(str(path) if relative.startswith("..") else relative)

    return f"forge resume -p {shown(Path(project_root))} --run-dir {shown(Path(run_dir))}"


def go_on_note(run_dir: Path, project_root: Path) -> str:
    """How to go on with a run that stopped: the ``forge resume`` command when the run has a
    checkpoint to continue from; else that it has none (the job never saved one)."""
    from forge.checkpoint.layout import find_checkpoints

    if any(info.valid for info in find_checkpoints(run_dir, verify_hashes=False)):
        return f"`{resume_command(run_dir, project_root)}` continues it from its newest checkpoint"
    return "it saved no checkpoint, so there is nothing to resume: train it again with forge train"


def parse_run_config(
    run_dir: Path, project: Any, overrides: list[str] = (), allow: list[str] = ()
) -> Any:
    """A run's ``config.yaml`` with ``--set`` overrides applied, checked (ConfigError lists
    every problem). Nothing is written."""
    from forge.config import ConfigError, parse_config

    config_path = run_dir / "config.yaml"
    try:
        text = config_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RunError(f"{config_path}: unreadable ({err}); {run_dir.name} cannot resume") from err
    try:
        cfg = parse_config(
            text,
            project=project,
            overrides=list(overrides),
            allow=list(allow),
            origin=str(config_path),
        )
        problems = cfg.check() if overrides else []
    except ConfigError as err:
        problems = err.problems
    if problems:
        for problem in problems:  # e.g. a --set the run's config has no key for
            if problem.file is None and problem.line is None:
                problem.file = str(config_path)
        raise ConfigError(problems, config=str(config_path))
    return cfg


def checkpoint_count(run_dir: Path) -> int:
    """The run's checkpoints on disk: those run.json records that are still there (rotation
    deletes old ones), and any committed one it does not record yet (a run killed between a
    background commit and the step that records it)."""
    entries = RunRecord.load(run_dir).data.get("checkpoints", [])
    recorded = {
        (Path(run_dir) / entry["path"]).name
        for entry in entries
        if "path" in entry and (Path(run_dir) / entry["path"]).is_dir()
    }
    return len(recorded | {path.name for _, path in committed_checkpoints(run_dir)})


def committed_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint of the run whose commit completed, oldest first."""
    return [(manifest.step, path) for path, manifest in committed_manifests(run_dir)]


def newest_step(run_dir: Path, data: dict[str, Any]) -> int:
    """The step a run has reached: what run.json says, or its newest committed checkpoint's
    when that is further (run.json is updated a step or more after a background commit)."""
    committed = committed_checkpoints(run_dir)
    return max(int(data.get("step") or 0), committed[-1][0] if committed else 0)


def configured_max_steps(cfg: Any) -> int | None:
    """``trainer.args.max_steps`` of a parsed config when it is a positive literal, else None
    (e.g. a run sized by ``num_train_epochs``)."""
    from forge.config.graph import CallNode

    trainer = cfg.targets.get("trainer")
    args = trainer.kwargs.get("args") if isinstance(trainer, CallNode) else None
    value = args.kwargs.get("max_steps") if isinstance(args, CallNode) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def nothing_to_resume(run_dir: Path, checkpoint: Path, cfg: Any, *, changed: bool) -> str | None:
    """Why resuming ``run_dir`` from ``checkpoint`` would train nothing, or None.

    A completed run is complete unless the resume changes something (``--set`` or ``--from``);
    any run whose checkpoint has reached the config's ``max_steps`` is complete too.
    """
    from forge.checkpoint.layout import parse_checkpoint_step

    data = RunRecord.load(run_dir).data
    max_steps = configured_max_steps(cfg)
    finished = data.get("status") == "completed" and not changed
    if finished and damaged_after(run_dir, checkpoint):
        return None  # its final weights are damaged: resuming from ``checkpoint`` rebuilds them
    step = parse_checkpoint_step(checkpoint)
    if finished or step is None:
        step = int(data.get("step") or 0)
    if not finished and not (max_steps is not None and step >= max_steps):
        return None
    of = f" of {max_steps}" if max_steps is not None else ""
    return (
        f"{Path(run_dir).name} is complete (step {step}{of}); nothing to do. "
        "To train longer: forge resume --set trainer.args.max_steps=N"
    )


def damaged_after(run_dir: Path, checkpoint: Path) -> list[Path]:
    """The run's checkpoints of a later step than ``checkpoint``, which discovery took for
    the newest valid one: damaged ones (their commit completed, and a file changed since)."""
    from forge.checkpoint.layout import find_checkpoints, parse_checkpoint_step

    step = parse_checkpoint_step(checkpoint)
    if step is None or Path(checkpoint).parent != Path(run_dir) / "checkpoints":
        return []
    found = find_checkpoints(Path(run_dir) / "checkpoints", verify_hashes=False)
    return [info.path for info in found if info.step > step]


def damaged_final_weights(
    run_dir: Path, checkpoint: Path, project_root: Path | None = None, *, resuming: bool = False
) -> str | None:
    """For a completed run whose newest checkpoint (its final weights) is damaged, so that
    ``checkpoint``, the newest valid one, is an earlier one: what happened and how to rebuild
    them (``resuming``: that this resume does); else None. ``project_root``: the run's
    project (default: the one that holds it)."""
    try:
        data = RunRecord.load(run_dir).data
    except RunError:
        return None
    completed = data.get("status") == "completed"
    project_root = project_root or _project_holding(Path(run_dir), data)
    damaged = damaged_after(run_dir, checkpoint) if completed else []
    if not damaged:
        return None
    earlier = Path(checkpoint).name
    rebuild = (
        f"resuming from {earlier} rebuilds them"
        if resuming
        else f"`{resume_command(run_dir, project_root)}` rebuilds them, training again from "
        f"{earlier}"
    )
    return (
        f"{Path(run_dir).name} completed, but its final weights ({damaged[-1].name}) are "
        f"damaged (`forge checkpoints --verify` names the file); {rebuild}"
    )


def _project_holding(run_dir: Path, data: dict[str, Any]) -> Path:
    """The project whose output holds ``run_dir`` (a moved project's, too), else the one
    run.json records."""
    for directory in run_dir.resolve().parents:
        if (directory / "meta.yaml").is_file():
            return directory
    return Path(data.get("project") or ".")


def failed_to_start(run_dir: Path, *, since: str) -> bool:
    """Whether a resume launched at ``since`` failed before its first step (the worker kept
    the run's status and recorded ``failed_resume``)."""
    try:
        failed = RunRecord.load(run_dir).data.get("failed_resume") or {}
    except RunError:
        return False
    return str(failed.get("at", "")) >= since


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` next to ``path`` and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
