"""Deterministic faults inside a checkpoint save, for forge's tests: a wrapper of the storage
seam (forge/checkpoint/storage.py) that makes a chosen rank fail or die at a chosen operation
of the save of a chosen step.

A spec reads ``POINT@STEP[:RANK]`` (``RANK``: the global rank; every rank when left out), and
``POINT`` is one of

``start``
    rank 0, the state snapshotted and nothing of the commit done yet (the temporary directory
    not created): between snapshot and commit;
``after:FILE``
    right after this rank wrote ``FILE`` into the temporary directory (``trainer.pt``,
    ``optimizer.pt``, ``rng-rank-00001.pt``, ...; ``model`` for a whole model's weights);
``before-manifest``
    rank 0, every file written and hashed, ``manifest.json`` not yet written;
``before-rename``
    rank 0, ``manifest.json`` written, the directory not yet renamed into place.

With ``record`` (``FORGE_TEST_RECORD_WRITES``: a directory) every file a rank writes into a
checkpoint is recorded as a JSON line ``{"rank", "step", "file", "bytes"}`` in
``RECORD/writes-rank-R.jsonl``: who writes what, and how much.

A ``kill`` spec makes the process send itself SIGKILL there (a crash: nothing is cleaned up);
a ``fail`` spec raises an ``OSError`` (EIO) there, as a failing disk would.

``hold_env(after=STEP, marker=...)`` makes rank 0 announce itself through a marker file at the
start of the first save of a step beyond ``STEP`` and wait there: the checkpoint of ``STEP`` is
committed and nothing later is, so that a test's own signal (SIGKILL to the launcher, say) lands
there however busy the machine, where a run of a small model may otherwise end between two looks
at its checkpoints.

In this process: ``inject(monkeypatch, fail=...)``, or ``CheckpointWriter(storage=
FaultyStorage(...))``. In processes a test starts (``forge train``, its torchrun workers):
``fault_env(kill=...)`` gives the environment under which ``site/sitecustomize.py`` installs
the wrapper at interpreter start, from ``FORGE_TEST_KILL_AT`` / ``FORGE_TEST_FAIL_AT``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forge.checkpoint.io import DEFAULT_HASH, TEMP_PREFIX
from forge.checkpoint.layout import parse_checkpoint_step
from forge.checkpoint.storage import CheckpointStorage, default_storage
from forge.checkpoint.writer import RECORDS_PREFIX

KILL_VAR = "FORGE_TEST_KILL_AT"
FAIL_VAR = "FORGE_TEST_FAIL_AT"
RECORD_VAR = "FORGE_TEST_RECORD_WRITES"
PAUSE_VAR = "FORGE_TEST_PAUSE_BEFORE_LOOP"
HOLD_VAR = "FORGE_TEST_HOLD_AFTER"
HOLD_MARKER_VAR = "FORGE_TEST_HOLD_MARKER"
PAUSE_S = 120  # how long the paused process waits for the test's signal before going on
SITE_DIR = Path(__file__).resolve().with_name("site")


def parse_spec(spec: str) -> tuple[str, int, int | None]:
    """``POINT@STEP[:RANK]`` as (point, step, rank or None)."""
    where, _, when = spec.rpartition("@")
    at_step, _, at_rank = when.partition(":")
    try:
        return where, int(at_step), int(at_rank) if at_rank else None
    except ValueError:
        raise ValueError(f"{spec!r} is not POINT@STEP[:RANK] (tests/faults)") from None


def _step_of(path: Path) -> int | None:
    """The step of the checkpoint a path is in (its temporary directory, or the directory)."""
    for part in (path, *path.parents):
        step = parse_checkpoint_step(part.name.removeprefix(TEMP_PREFIX))
        if step is not None:
            return step
    return None


def _in_checkpoint(path: Path) -> str:
    """``path`` relative to the checkpoint's temporary directory (``trainer.pt``)."""
    for parent in path.parents:
        if parent.name.startswith(TEMP_PREFIX):
            return path.relative_to(parent).as_posix()
    return path.name


class FaultyStorage(CheckpointStorage):
    """``inner`` (by default the process's storage), killing or failing at ``kill`` / ``fail``
    on rank ``rank``."""

    def __init__(
        self,
        *,
        kill: str | None = None,
        fail: str | None = None,
        rank: int = 0,
        inner: CheckpointStorage | None = None,
        record: str | None = None,
        hold_after: int | None = None,
        hold_marker: str | None = None,
    ) -> None:
        self.record = Path(record) if record else None
        self.kill = parse_spec(kill) if kill else None
        self.fail = parse_spec(fail) if fail else None
        self.hold_after = hold_after
        self.hold_marker = hold_marker
        self._held = False
        self.rank = rank
        self.inner = inner if inner is not None else default_storage()

    def _matches(self, spec: tuple[str, int, int | None] | None, point: str, step: int) -> bool:
        if spec is None:
            return False
        where, at_step, at_rank = spec
        return where == point and at_step == step and at_rank in (None, self.rank)

    def point(self, point: str, path: Path) -> None:
        """Kill this process or raise here when asked to; otherwise do nothing."""
        step = _step_of(path)
        if step is None:
            return
        if self._matches(self.kill, point, step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._matches(self.fail, point, step):
            raise OSError(
                errno.EIO, f"injected at {point} of step {step} on rank {self.rank} ({FAIL_VAR})"
            )

    def _record(self, path: Path) -> None:
        if self.record is None or not path.is_file() or path.name.startswith(RECORDS_PREFIX):
            return  # a rank's hashes for rank 0 are no file of the checkpoint
        line = {
            "rank": self.rank,
            "step": _step_of(path),
            "file": _in_checkpoint(path),
            "bytes": path.stat().st_size,
        }
        with open(self.record / f"writes-rank-{self.rank:05d}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def start(self, checkpoints_dir: Path, path: Path) -> None:
        step = _step_of(path)
        if self.hold_after is not None and not self._held and (step or 0) > self.hold_after:
            self._held = True
            _announce_and_wait(self.hold_marker, wake=True)
        self.point("start", path)
        self.inner.start(checkpoints_dir, path)

    def write_torch(self, path: Path, obj: Any, **kwargs: Any) -> Any:
        record = self.inner.write_torch(path, obj, **kwargs)
        self._record(path)
        self.point(f"after:{_in_checkpoint(path)}", path)
        return record

    def write_bytes(self, path: Path, data: bytes, **kwargs: Any) -> Any:
        record = self.inner.write_bytes(path, data, **kwargs)
        self._record(path)
        self.point(f"after:{_in_checkpoint(path)}", path)
        return record

    def write_tensors(
        self, path: Path, tensors: Mapping[str, Any], metadata: dict | None, **kwargs: Any
    ) -> Any:
        record = self.inner.write_tensors(path, tensors, metadata, **kwargs)
        self._record(path)
        self.point(f"after:{_in_checkpoint(path)}", path)
        return record

    def write_model(self, directory: Path, model: Any, state_dict: Any, **kwargs: Any) -> None:
        before = set(directory.iterdir())
        self.inner.write_model(directory, model, state_dict, **kwargs)
        for path in sorted(set(directory.iterdir()) - before):
            self._record(path)
        self.point("after:model", directory)

    def hash_files(self, paths: list[Path], algorithm: str = DEFAULT_HASH) -> list[tuple[int, str]]:
        return self.inner.hash_files(paths, algorithm)

    def write_manifest(self, path: Path, data: bytes) -> None:
        self.point("before-manifest", path)
        self.inner.write_manifest(path, data)

    def rename(self, path: Path, final_path: Path) -> None:
        self.point("before-rename", path)
        self.inner.rename(path, final_path)


def inject(monkeypatch: Any, *, kill: str | None = None, fail: str | None = None) -> None:
    """Make this process's saves fault as asked, for the rest of the test (pytest's
    ``monkeypatch`` puts the default storage back)."""
    import forge.checkpoint.storage as storage

    monkeypatch.setattr(storage, "_default", FaultyStorage(kill=kill, fail=fail))


def hold_env(*, after: int, marker: str | os.PathLike) -> dict[str, str]:
    """The environment (to add to a child's) under which rank 0, at the start of the first save
    of a step beyond ``after``, creates ``marker`` and waits there for the test's signal (up to
    PAUSE_S, then goes on)."""
    env = fault_env()
    env[HOLD_VAR] = str(after)
    env[HOLD_MARKER_VAR] = str(marker)
    return env


def _announce_and_wait(marker: str | None, *, wake: bool = False) -> None:
    """Create ``marker`` and wait up to PAUSE_S, until a signal ends the process or raises out
    of here; with ``wake``, also once a stop signal the process handles (forge's handlers note
    it and return) has been handled."""
    import threading
    import time

    woken = []
    before = {}
    if wake and threading.current_thread() is threading.main_thread():
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            previous = signal.getsignal(number)
            if callable(previous):

                def note_and_handle(signum, frame, previous=previous):
                    woken.append(signum)
                    previous(signum, frame)

                before[number] = previous
                signal.signal(number, note_and_handle)
    try:
        if marker:
            Path(marker).write_text(str(os.getpid()))
        deadline = time.monotonic() + PAUSE_S
        while time.monotonic() < deadline and not woken:
            time.sleep(0.05)
    finally:
        for number, previous in before.items():
            signal.signal(number, previous)


def fault_env(
    *, kill: str | None = None, fail: str | None = None, record: str | os.PathLike | None = None
) -> dict[str, str]:
    """The environment (to add to a child's) under which every Python process the child
    starts saves with a ``FaultyStorage`` (its rank from ``RANK``)."""
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE_DIR), os.environ.get("PYTHONPATH")]))
    }
    if kill:
        env[KILL_VAR] = kill
    if fail:
        env[FAIL_VAR] = fail
    if record:
        env[RECORD_VAR] = str(record)
    return env


def pause_env(marker: str | os.PathLike) -> dict[str, str]:
    """The environment (to add to a child's) under which a process that trains stops just
    before its training loop takes over the stop signals: it creates ``marker`` and waits there
    (up to PAUSE_S, then goes on), so that a test's signal lands while the job is still
    starting, however busy the machine, instead of after some steps no test can predict."""
    env = fault_env()
    env[PAUSE_VAR] = str(marker)
    return env


def pause_before_the_loop(marker: str) -> None:
    """Wrap ``StopSignals.__enter__`` (the loop taking over the stop signals) to announce itself
    through ``marker`` and wait there; the first time only."""
    from forge.train import signals

    enter = signals.StopSignals.__enter__
    paused = []

    def announce_and_wait(self):
        if not paused:
            paused.append(True)
            _announce_and_wait(marker)  # a stop signal raises out of here
        return enter(self)

    signals.StopSignals.__enter__ = announce_and_wait


def install_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Install a ``FaultyStorage`` from ``FORGE_TEST_KILL_AT`` / ``FORGE_TEST_FAIL_AT`` as this
    process's default (site/sitecustomize.py calls this at interpreter start)."""
    from forge.checkpoint.storage import use_storage

    if environ.get(PAUSE_VAR):
        pause_before_the_loop(environ[PAUSE_VAR])
    kill, fail, record = environ.get(KILL_VAR), environ.get(FAIL_VAR), environ.get(RECORD_VAR)
    hold = environ.get(HOLD_VAR)
    if kill or fail or record or hold:
        rank = int(environ.get("RANK", "0"))
        use_storage(
            FaultyStorage(
                kill=kill,
                fail=fail,
                rank=rank,
                record=record,
                hold_after=int(hold) if hold else None,
                hold_marker=environ.get(HOLD_MARKER_VAR),
            )
        )
