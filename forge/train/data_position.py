"""Checkpoint components that belong to the loop rather than to a library object.

``DataPosition`` is where this rank is in the training data: the loop takes its batches from
it, and as a rank-scoped checkpoint component it saves and restores the loader's position
inside the epoch. The trainer's own counters (step, epoch, best metric, log tally) are the
trainer's ``state_dict()`` (see ``BaseTrainer``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from forge.checkpoint import CheckpointError

logger = logging.getLogger(__name__)


class DataPosition:
    """This rank's place in the training data: the epoch, the micro-batches taken from it, and
    the loader's own state.

    The loop reads it: ``epoch_batches(epoch)`` gives the batches still to take (the rest of a
    restored epoch, else the whole epoch), ``took(n)`` counts them, ``end_epoch()`` moves on.
    The epoch and batch count are also the trainer's counters (shared: every rank agrees on
    them); a resume gives them back through ``seek`` before this component is restored, and
    after the trainer's counters but before the random generators, because ``iter()`` over
    the restored loader draws a seed, as the uninterrupted run did at the start of that epoch.
    """

    def __init__(self, loader: Any = None, *, is_main: bool = True) -> None:
        self.loader = loader
        self.epoch = 0
        self.batch = 0
        self.restored = False  # the loader's state came from a checkpoint
        self._is_main = is_main  # logs its warning once, on rank 0
        self._resumed: Iterator[Any] | None = None  # the rest of a restored epoch

    # ------------------------------------------------------------------ what the loop reads
    def epoch_batches(self, epoch: int) -> Iterator[Any]:
        """The batches of ``epoch`` still to take: after a restore, the rest of the saved
        epoch; otherwise the loader from the start of ``epoch``."""
        batches, self._resumed = self._resumed, None
        if batches is not None:  # not `or`: a loader iterator's truth is its length
            return batches
        self.epoch, self.batch = epoch, 0
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def took(self, count: int) -> None:
        """``count`` more micro-batches were taken from the current epoch."""
        self.batch += count

    def end_epoch(self) -> None:
        """The current epoch ran to its end; the next starts at its first batch."""
        self.epoch, self.batch = self.epoch + 1, 0

    def skip(self, count: int) -> int:
        """Take the next ``count`` micro-batches of the current epoch and drop them (a
        rollback's window, forge/train/rollback.py); at most to the epoch's end. They count as
        taken, so a checkpoint saved after it resumes past them. Returns how many it dropped."""
        batches = self.epoch_batches(self.epoch)
        dropped = sum(1 for _ in itertools.islice(batches, count))
        self.batch += dropped
        self._resumed = batches  # the rest of the epoch, for the loop
        return dropped

    @property
    def fraction(self) -> float:
        """Epochs done, with the fraction of the current one (``TrainerState.epoch``)."""
        return self.epoch + self.batch / len(self.loader)

    # ------------------------------------------------------------------ resume
    def seek(self, epoch: int, batch: int) -> None:
        """The position the trainer's counters restored (before this component loads)."""
        self.epoch, self.batch = epoch, batch

    def restart_epoch_unless_restored(self) -> None:
        """After a resume that did not restore the loader (not saved, not asked for, or saved
        by another data-parallel size): the saved epoch restarts from its first batch, unless
        it had ended."""
        if not self.restored and self.batch < len(self.loader):
            self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loader = self.loader
        self.restored = True
        if self.batch >= len(loader):
            # every batch of the epoch was taken (its loader may be finished, and a finished
            # loader's state would restart the epoch): the loop ends the epoch, then goes on
            self._resumed = iter(())
        elif self.batch > 0:
            try:
                loader.load_state_dict(state["loader"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"the saved data loader state does not fit: {exc}") from exc
            loader.set_epoch(self.epoch)
            self._resumed = iter(loader)
        # else an epoch boundary: the loop starts the epoch afresh

    def on_reshape(self, description: str) -> None:
        """Another data-parallel size: per-rank positions cannot map; restart the epoch."""
        if self._is_main:
            logger.warning(
                "%s: per-rank random and data positions cannot be restored exactly; epoch %d "
                "restarts from its first batch",
                description,
                self.epoch,
            )
