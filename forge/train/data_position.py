"""Checkpoint components that belong to the loop rather than to a library object.

``DataPosition`` is where this rank is in the training data: the loop takes its batches from
it, and as a rank-scoped checkpoint component it saves and restores the loader's position
inside the epoch. Saved by another data-parallel size, the epoch continues: the items its
global order has not used yet are dealt to this job's ranks (``reshape``;
forge/data/sampler.py). The trainer's own counters (step, epoch, best metric, log tally) are the
trainer's ``state_dict()`` (see ``BaseTrainer``).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from forge.checkpoint import CheckpointError
from forge.data.loader import saved_position

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBatch:
    """What one optimizer step takes: ``per_device`` items (None: a token budget) times
    ``accumulation`` micro-batches times ``replicas`` data-parallel ranks."""

    per_device: int | None
    accumulation: int
    replicas: int

    @property
    def size(self) -> int | None:
        if self.per_device is None:
            return None
        return self.per_device * self.accumulation * self.replicas

    def describe(self) -> str:
        if self.per_device is None:
            return f"token budget x {self.accumulation} x {self.replicas}"
        return f"{self.size} ({self.per_device} x {self.accumulation} x {self.replicas})"


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

    def __init__(
        self,
        loader: Any = None,
        *,
        is_main: bool = True,
        step_batch: StepBatch | None = None,
        key: str = "trainer.args",
    ) -> None:
        self.loader = loader
        self.epoch = 0
        self.batch = 0
        self.restored = False  # the loader's state came from a checkpoint
        self.step_batch = step_batch
        self._key = key  # where the training arguments are, for messages
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
        """After a resume that did not restore the loader (not saved, or not asked for): the
        saved epoch restarts from its first batch, unless it had ended."""
        if not self.restored and 0 < self.batch < len(self.loader):
            if self._is_main:
                logger.warning(
                    "the data position was not restored (%s.ignore_data_skip or "
                    "restore_dataloader_state: false, or not saved): epoch %d restarts from "
                    "its first batch, its items used before the checkpoint seen again",
                    self._key,
                    self.epoch,
                )
            self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        state = {"loader": self.loader.state_dict(), "epoch_batches": len(self.loader)}
        if self.step_batch is not None:
            state["step_batch"] = asdict(self.step_batch)
        return state

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

    def reshape(self, description: str, states: list[dict[str, Any]]) -> None:
        """Another data-parallel size saved ``states`` (one per saved rank): the saved epoch
        continues, its items not used yet dealt to this job's ranks, each once."""
        saved = states[0]
        self.restored = True
        if self.batch == 0:  # an epoch boundary: the loop starts the epoch afresh
            self._say_reshaped(description, saved, f"epoch {self.epoch} starts afresh")
            return
        if self.batch >= saved.get("epoch_batches", math.inf):
            self._resumed, self.batch = iter(()), len(self.loader)  # the epoch had ended
            self._say_reshaped(description, saved, f"epoch {self.epoch + 1} starts afresh")
            return
        fix = (
            f"set {self._key}.ignore_data_skip: true to restart epoch {self.epoch} from its "
            "first batch instead (its items used before the checkpoint are seen again)"
        )
        sampler = self.loader.positions
        cannot = f"{description}: the rest of epoch {self.epoch} cannot be dealt to "
        cannot += f"{sampler.num_replicas} data-parallel rank(s)"
        if len({saved_position(state.get("loader")) for state in states}) != 1:
            raise CheckpointError(f"{cannot}: the saved ranks' data positions differ; {fix}")
        try:
            used, total = self.loader.continue_from(saved["loader"])
        except ValueError as exc:
            raise CheckpointError(f"{cannot}: {exc}; {fix}") from None
        units = len(sampler.epoch_order())
        left = units if self.loader.batch_size is None else len_batches(units, self.loader)
        self.batch = len(self.loader) - left
        self._resumed = iter(self.loader)
        where = (
            f"epoch {self.epoch} continues: {used} of its {total} items were used, the other "
            f"{total - used} are dealt to {sampler.num_replicas} data-parallel rank(s) "
            f"({units} each)"
        )
        self._say_reshaped(description, saved, where)

    def _say_reshaped(self, description: str, saved: dict[str, Any], where: str) -> None:
        """One line on rank 0: where the epoch goes on, and the global batch before and now."""
        if self._is_main:
            logger.warning("%s: %s; %s", description, where, self._global_batch_change(saved))

    def _global_batch_change(self, saved: dict[str, Any]) -> str:
        """The global batch before and now, and how to keep the saved one."""
        now = self.step_batch
        if now is None:
            return "the batch per step follows the number of ranks"
        before = StepBatch(**saved["step_batch"]) if saved.get("step_batch") else None
        if before is None:
            return f"the global batch is now {now.describe()}"
        said = f"the global batch was {before.describe()}, it is now {now.describe()}"
        if before.size == now.size:
            return said.replace(", it is now", " and stays")
        if before.size is None or now.size is None:
            return said
        ways = []
        for name, other in (
            ("gradient_accumulation_steps", now.per_device),
            ("per_device_train_batch_size", now.accumulation),
        ):
            value, rest = divmod(before.size, other * now.replicas)
            if value >= 1 and not rest:
                ways.append(f"--set {self._key}.{name}={value}")
        if not ways:
            return said + (
                f"; no accumulation keeps {before.size} items per step on {now.replicas} "
                "rank(s) with this per-device batch"
            )
        return said + f"; to keep {before.size} per step, resume with " + " or ".join(ways)


def len_batches(items: int, loader: Any) -> int:
    """Batches ``loader`` makes of ``items`` (its batch size and drop_last)."""
    whole, rest = divmod(items, loader.batch_size)
    return whole + (1 if rest and not loader.drop_last else 0)
