"""Checkpoint components that belong to the loop rather than to a library object.

``DataPosition`` is the rank-scoped position of this rank's data loader inside the current
epoch. The trainer's own counters (step, epoch, best metric, log tally) are the trainer's
``state_dict()`` (see ``BaseTrainer``).
"""

from __future__ import annotations

import logging
from typing import Any

from forge.checkpoint import CheckpointError

logger = logging.getLogger(__name__)


class DataPosition:
    """This rank's loader state within the epoch the trainer's position names.

    Restored after the trainer's counters (which hold the epoch and batch) and before the
    random generators, because ``iter()`` over the restored loader draws a seed, as the
    uninterrupted run did at the start of that epoch.
    """

    def __init__(self, trainer: Any) -> None:  # a BaseTrainer (no import: base imports this)
        self.trainer = trainer
        self.restored = False

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.trainer.train_loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        position, loader = trainer._position, trainer.train_loader
        self.restored = True
        if position.batch >= len(loader):
            # every batch of the epoch was taken (its loader may be finished, and a finished
            # loader's state would restart the epoch): the loop ends the epoch, then goes on
            trainer._resumed_batches = iter(())
        elif position.batch > 0:
            try:
                loader.load_state_dict(state["loader"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"the saved data loader state does not fit: {exc}") from exc
            loader.set_epoch(position.epoch)
            trainer._resumed_batches = iter(loader)
        # else an epoch boundary: the loop starts the epoch afresh

    def on_reshape(self, description: str) -> None:
        """Another data-parallel size: per-rank positions cannot map; restart the epoch."""
        trainer = self.trainer
        trainer._info(
            "%s: per-rank random and data positions cannot be restored exactly; epoch %d "
            "restarts from its first batch",
            description,
            trainer._position.epoch,
            level=logging.WARNING,
        )
