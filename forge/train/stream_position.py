"""Where this rank is in a training *stream* (forge/data/streams.py): the checkpoint component
that takes the place of ``DataPosition`` when the training dataset is an iterable one.

A stream has no length: the loop reads it as one endless epoch (each loader slot counts its own
passes over the data) until ``max_steps``. The saved state is the loader's, per rank and per
worker: epoch, shard, position in the shard, shuffle buffer — a resume seeks it, never replays
the steps before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from forge.checkpoint import CheckpointError
from forge.data.streams import StreamError, slot_states

logger = logging.getLogger(__name__)


class StreamPosition:
    """``DataPosition``'s interface (forge/train/data_position.py) over a ``StreamLoader``."""

    def __init__(
        self,
        loader: Any,
        *,
        is_main: bool = True,
        fix: str = "",
        on_saved: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.loader = loader
        self.epoch = 0  # the loop's epoch: always 0, the stream's passes are in ``passes``
        self.batch = 0
        self.restored = False
        self.passes = 0.0  # the stream's epochs done, as last saved or restored
        self._is_main = is_main
        self._fix = fix  # how to accept an inexact continuation (ignore_data_skip)
        self._iterator: Iterator[Any] | None = None
        self._saved: dict[str, int] = {}  # the position restored
        self._on_saved = on_saved  # told each position a checkpoint takes (run records)

    # ------------------------------------------------------------------ what the loop reads
    def epoch_batches(self, epoch: int) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        return self._batches(self._iterator)

    def _batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        yield from batches
        raise StreamError(
            "the training stream ended: this rank's share of it holds no item (every loader "
            "worker read a whole pass and found nothing); check the dataset yields items, and "
            "that it has at least as many items (or shards) as ranks x dataloader_num_workers"
        )

    def took(self, count: int) -> None:
        self.batch += count

    def end_epoch(self) -> None:  # pragma: no cover - an endless stream never ends an epoch
        self.epoch, self.batch = self.epoch + 1, 0

    @property
    def fraction(self) -> float:
        """The stream's passes: live where it is read in this process, else as last saved."""
        live = self.loader.live_epoch()
        return self.passes if live is None else float(live)

    def describe(self) -> str:
        """The stream and, after a resume, where it continues."""
        stream = self.loader.dataset
        text = (
            f"{type(stream.dataset).__name__}, {stream.source.num_shards} shard(s), "
            f"shuffle buffer {stream.shuffle_buffer if stream.shuffle else 0}"
        )
        if self.restored and self._saved:
            text += (
                f"; resumed in epoch {self._saved['epoch']} after {self._saved['shards']} "
                f"shard(s) and {self._saved['items']} item(s) of it"
            )
        return text

    # ------------------------------------------------------------------ resume
    def seek(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch

    def restart_epoch_unless_restored(self) -> None:
        """A resume that did not restore the stream (``ignore_data_skip``): it starts again
        from its first item, and says so."""
        if not self.restored and self.batch > 0:
            if self._is_main:
                logger.warning(
                    "the stream's position is not restored (ignore_data_skip): it starts again "
                    "from its first item, not where step %d left it",
                    self.batch,
                )
            self.batch = 0

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        position = self.loader.position(state)
        self.passes = float(position["epoch"])
        if self._on_saved is not None:
            self._on_saved(dict(position))
        return {"stream": state, "position": position, "batch_size": self.loader.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("stream")
        if saved is None:
            raise CheckpointError(
                "the saved data position is not a stream's (the training dataset was map-style "
                f"when it was saved); resume with that dataset{self._or_fix()}"
            )
        slots = {s["slots"] for s in slot_states(saved)}
        workers = max(self.loader.num_workers, 1)
        if slots and slots != {self._slots(workers)} and self.loader.dataset.world_size == 1:
            # this one rank saved every reader's position: they are dealt to its workers
            self.reshape(
                f"the stream position was saved for {slots.pop()} loader worker(s), this job "
                f"has {workers}",
                [state],
            )
            return
        if slots and slots != {self._slots(workers)}:
            raise CheckpointError(
                f"the stream position was saved for {slots.pop()} readers (ranks x loader "
                f"workers), this job has {self._slots(workers)}; resume with the same "
                f"dataloader_num_workers{self._or_fix()}"
            )
        try:
            self.loader.load_state_dict(saved)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the saved stream position does not fit: {exc}") from exc
        self._saved = state.get("position") or {}
        self.passes = float(self._saved.get("epoch", 0))
        self.restored = True

    def _slots(self, workers: int) -> int:
        return self.loader.dataset.world_size * workers

    def _or_fix(self) -> str:
        return f", or {self._fix}" if self._fix else ""

    def reshape(self, description: str, states: list[dict[str, Any]]) -> None:
        """Another count of readers (data-parallel ranks x loader workers) saved ``states``
        (one per saved rank): the shards of the saved epoch no reader finished, and the items
        in the saved shuffle buffers, are dealt to this job's readers, each once (a partly
        read shard goes on from its saved offset); the epochs after it are split as this job
        splits them. Refused where that cannot be exact: a mixture, a packed stream's carried
        tokens, or readers that kept 1 item in N of each shard (too few shards to deal)."""
        loader, stream = self.loader, self.loader.dataset
        readers = stream.world_size * max(loader.num_workers, 1)
        cannot = f"{description}: the training stream cannot be continued exactly by {readers} "
        cannot += "reader(s) (ranks x loader workers)"
        keep = f"resume with the saved process count and dataloader_num_workers{self._or_fix()}"
        if any(state.get("stream") is None for state in states):
            raise CheckpointError(
                "the saved data position is not a stream's (the training dataset was map-style "
                f"when it was saved); resume with that dataset{self._or_fix()}"
            )
        if callable(getattr(stream.dataset, "slot_stream", None)):
            raise CheckpointError(
                f"{cannot}: a mixture's readers each draw from every source; {keep}"
            )
        batch_size = int(states[0].get("batch_size") or loader.batch_size)
        try:
            dealt = loader.continue_from([state["stream"] for state in states], batch_size)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{cannot}: {exc}; {keep}") from None
        self._saved = dict(states[0].get("position") or {})
        self.passes = float(dealt["epoch"])
        self.restored = True
        if self._is_main:
            logger.warning(
                "%s: the stream continues in its epoch %d: %d shard(s) not finished by the %d "
                "saved reader(s) and %d item(s) of their shuffle buffers are dealt to %d "
                "reader(s) (ranks x loader workers), each once; later epochs are split over "
                "them",
                description,
                dealt["epoch"],
                dealt["shards"],
                dealt["slots"],
                dealt["buffered"],
                readers,
            )
