"""Rolling a run back: restore the last checkpoint before a divergence began (weights,
optimizer, schedule, random state, data position, callbacks' state), drop the batches of the
offending window, and train on, as large-model practice answers a loss spike.

A callback asks for it by setting ``control.rollback`` to a ``RollbackRequest`` (the divergence
detector does: forge/train/divergence.py); the loop raises ``RollBack`` at the step boundary
and ``roll_back`` restores in place, then the loop starts again from the restored step, as a
resume would. Every rank decides at the same step (the request comes from numbers every rank
logs alike), so every rank restores the same checkpoint and drops the same window.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.checkpoint import CheckpointError, find_checkpoints

logger = logging.getLogger(__name__)


@dataclass
class RollbackRequest:
    """Roll back from ``step`` (where the divergence was seen) to the newest valid checkpoint at
    least ``anchor_before`` steps before it, and drop the batches from there up to ``skip_past``
    steps past ``step``. ``done`` is told what was done (after the restore, so what it records
    survives the restored state)."""

    step: int
    reason: str
    skip_past: int = 0
    anchor_before: int = 1
    done: Callable[[dict[str, Any]], None] | None = None
    #: told why there is no rollback (no checkpoint early enough): the requester stops the run
    refused: Callable[[str], None] | None = None


class RollBack(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the loop at a step boundary when a callback asked for a rollback."""

    def __init__(self, request: RollbackRequest) -> None:
        super().__init__(f"rollback from step {request.step}")
        self.request = request


def rollback_anchor(checkpoints_dir: Path, before: int) -> Path | None:
    """The newest valid checkpoint at a step up to ``before``, or None."""
    valid = [info for info in find_checkpoints(checkpoints_dir) if info.valid]
    earlier = [info for info in valid if info.step <= before]
    return earlier[-1].path if earlier else None


def rollback_anchor_before(callbacks: Any) -> int | None:
    """The farthest any callback may roll back before the step it asks at (its
    ``rollback_anchor_before``), or None when none rolls back: rotation keeps that anchor."""
    found = [getattr(c, "rollback_anchor_before", None) for c in callbacks]
    found = [n for n in found if isinstance(n, int)]
    return max(found) if found else None


def can_roll_back(trainer: Any, request: RollbackRequest) -> bool:
    """Whether a checkpoint is early enough for ``request``, once every save in flight is
    committed (so the answer never depends on how fast a background commit ran); if not, the
    requester is told why."""
    trainer.checkpoints.wait()
    before = request.step - request.anchor_before
    if rollback_anchor(trainer.checkpoints_dir, before) is not None:
        return True
    if request.refused is not None:
        request.refused(f"no checkpoint at or before step {before} to roll back to")
    return False


def roll_back(trainer: Any, request: RollbackRequest) -> None:
    """Restore ``trainer`` to the request's anchor and drop the window's batches."""
    trainer.checkpoints.wait()  # a commit in flight may be the anchor
    anchor = rollback_anchor(trainer.checkpoints_dir, request.step - request.anchor_before)
    if anchor is None:  # the requester checks first; a checkpoint that went since is an error
        raise CheckpointError(
            f"cannot roll back from step {request.step}: no valid checkpoint at or before step "
            f"{request.step - request.anchor_before} in {trainer.checkpoints_dir}"
        )
    trainer._load_checkpoint(anchor)
    restored = trainer.state.global_step
    steps = request.step - restored + request.skip_past
    accumulation = trainer.args.gradient_accumulation_steps
    position = trainer.data_position
    first = (position.epoch, position.batch)
    wanted = steps * accumulation
    dropped = position.skip(wanted)
    entry = {
        "from_step": request.step,
        "to_checkpoint": anchor.name,
        "to_step": restored,
        "skipped": {"epoch": first[0], "first_batch": first[1], "batches": dropped},
        "reason": request.reason,
    }
    if dropped < wanted:  # a skip stops at the epoch's end: said, and kept in the record
        entry["skipped"]["not_dropped"] = wanted - dropped
        if trainer.is_main_process:
            logger.warning(
                "the rollback's window of %d micro-batches ran past the end of epoch %d: the "
                "%d of that epoch were dropped, the other %d (the first of epoch %d) are trained "
                "on; lower skip_past or anchor_before to keep a window inside one epoch",
                wanted,
                first[0],
                dropped,
                wanted - dropped,
                first[0] + 1,
            )
    trainer.state.epoch = position.fraction
    if request.done is not None:
        request.done(entry)
    if trainer.is_main_process:
        logger.warning(
            "rolled back from step %d to %s (step %d): dropped micro-batches %d-%d of epoch %d "
            "(%s)",
            request.step,
            anchor.name,
            restored,
            first[1],
            first[1] + dropped - 1,
            first[0],
            request.reason,
        )
