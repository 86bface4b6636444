"""Deterministic faults inside a checkpoint save, for forge's own tests only.

Two environment variables, unset in any real run (then each point costs one dictionary
lookup), make a chosen rank fail at a chosen point of the save of a chosen step, so tests can
drive crashes through the real CLI and check that a resume is still exact and that no rank
waits forever:

``FORGE_TEST_KILL_AT=POINT@STEP[:RANK]``
    the process sends itself SIGKILL there (a crash: nothing is cleaned up);
``FORGE_TEST_FAIL_AT=POINT@STEP[:RANK]``
    an ``OSError`` (EIO) is raised there, as a failing disk would.

``RANK`` is the global rank (every rank when left out). ``POINT`` is one of

``after:FILE``
    right after this rank wrote ``FILE`` into the temporary directory (``trainer.pt``,
    ``optimizer.pt``, ``rng-rank-00001.pt``, ...; ``model`` for the model's weights), i.e.
    between two of the save's file writes;
``before-manifest``
    rank 0, every file written and hashed, ``manifest.json`` not yet written;
``before-rename``
    rank 0, ``manifest.json`` written, the directory not yet renamed into place.
"""

from __future__ import annotations

import errno
import os
import signal

KILL_VAR = "FORGE_TEST_KILL_AT"
FAIL_VAR = "FORGE_TEST_FAIL_AT"


def _matches(spec: str, point: str, step: int, rank: int) -> bool:
    where, _, when = spec.rpartition("@")
    at_step, _, at_rank = when.partition(":")
    try:
        return where == point and int(at_step) == step and (not at_rank or int(at_rank) == rank)
    except ValueError:
        raise ValueError(
            f"{spec!r} is not POINT@STEP[:RANK] (forge/checkpoint/faults.py)"
        ) from None


def fault_point(point: str, step: int, rank: int) -> None:
    """Kill this process or raise here when a test asked for it; otherwise do nothing."""
    kill = os.environ.get(KILL_VAR)
    if kill and _matches(kill, point, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    fail = os.environ.get(FAIL_VAR)
    if fail and _matches(fail, point, step, rank):
        raise OSError(errno.EIO, f"injected at {point} of step {step} on rank {rank} ({FAIL_VAR})")
