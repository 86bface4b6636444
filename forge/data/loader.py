"""Sharded, resumable data loading on top of torchdata's ``StatefulDataLoader``.

How a trainer uses it::

    loader = build_dataloader(dataset, batch_size=8, rank=rank, world_size=world, seed=seed)
    if resuming:
        loader.load_state_dict(state["data"])      # restores the epoch and the position in it
    for epoch in range(start_epoch, num_epochs):
        loader.set_epoch(epoch)                    # before each epoch's iter()
        for batch in loader:                       # on resume: the rest of the saved epoch
            ...
            if step % save_steps == 0:
                state["data"] = loader.state_dict()  # at a step boundary, after the batch

``loader.state_dict()`` is the ``StatefulDataLoader`` state; it names the epoch and how many
samples of this rank's shard were consumed. Every rank is at the same position, so one
rank's state can be loaded on all ranks. A state taken right after an epoch's last batch
resumes to an empty remainder of that epoch; ``set_epoch(epoch + 1)`` then starts the next
epoch. ``set_epoch`` with an epoch other than the saved one discards the saved position and
starts that epoch from its beginning.

What this fixes in torchdata 0.11 (its last release), whose ``StatefulDistributedSampler``
keeps ``yielded`` in a generator that only resets when its first item is drawn:

* a state taken at the start of an epoch (after ``iter()``, before the first batch) still
  carries the previous epoch's count, so the resumed epoch yields nothing;
* a state taken after an epoch's ``StopIteration`` leaves a pending skip in the sampler
  that swallows the whole next epoch (with ``num_workers=0``);
* the state has no epoch, so resuming without the exact ``set_epoch`` call replays the
  wrong permutation silently; a different seed, world size or dataset size is not detected;
* with workers, ``state_dict()`` before the first ``iter()`` builds an iterator that
  prefetches indices of the epoch set at that moment; a following ``set_epoch`` is ignored.

:class:`ResumableDistributedSampler` resets its position eagerly in ``__iter__``, applies a
loaded position exactly once, and keeps ``{epoch, yielded, seed, ...}`` in its state;
:class:`ResumableDataLoader` adds ``set_epoch`` and checks states when they are loaded
(it reads ``next_iter_state`` and ``_initial_iter_for_state_dict``, which torchdata 0.11's
``StatefulDataLoader`` keeps as attributes).
"""

from __future__ import annotations

import hashlib
import logging
import random
import signal
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import Dataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from forge.data.sampler import ResumableDistributedSampler
from forge.lifetime import (
    helper_context,
    ignore_stop_signals,
    kill_helpers_at_exit,
    signal_on_parent_death,
)

logger = logging.getLogger(__name__)


class WorkerSeededBatches(Dataset):
    """``dataset`` as a loader's worker processes fetch it: before each batch, the worker's
    random generators (Python's, numpy's and torch's) are seeded from (``seed``, ``rank``, the
    batch's epoch, the batch's indices). What a batch draws (an augmentation in
    ``__getitem__``, noise the collator adds) is then a function of the batch alone, whichever
    worker fetches it, however many workers there are, and wherever a resumed run starts, so a
    resume is exact with workers too. Fetched in the main process (no workers), the batch
    draws from the main generators, which a checkpoint saves and restores."""

    def __init__(self, dataset: Dataset, seed: int, rank: int = 0) -> None:
        self.dataset = dataset
        self.seed = seed
        self.rank = rank

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(index)]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if get_worker_info() is not None:
            seed_generators(batch_seed(self.seed, self.rank, indices))
        plain = [int(index) for index in indices]
        fetch = getattr(self.dataset, "__getitems__", None)
        return list(fetch(plain)) if fetch else [self.dataset[index] for index in plain]

    def __getattr__(self, name: str) -> Any:  # the dataset's own attributes (columns, ...)
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def batch_seed(seed: int, rank: int, indices: list[int]) -> int:
    """A 64-bit seed for one batch: of the run's seed, the rank, the batch's epoch (carried by
    its indices: ``EpochIndex``; 0 for indices without one) and its indices."""
    epoch = getattr(indices[0], "epoch", 0) if indices else 0
    text = f"{seed}:{rank}:{epoch}:" + ",".join(str(int(i)) for i in indices)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def seed_generators(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators of this process from one 64-bit seed."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def die_with_parent(worker_id: int) -> None:
    """A loader worker's first act: it dies with the process that started it (a training rank
    killed with SIGKILL leaves no worker behind, holding the run's lock and files), and of
    nothing else a job is sent: SIGTERM, Ctrl-C and a scheduler's warning signal reach every
    process of a job (its process group, SLURM's step, torchrun's ``killpg`` of a rank), and a
    worker that died of one would fail its rank before the rank has saved its checkpoint."""
    signal_on_parent_death(signal.SIGKILL)
    ignore_stop_signals()


def job_workers(multiprocessing_context: str | None = None) -> dict[str, Any]:
    """The ``DataLoader`` keywords that make its worker processes helpers of a training job:
    each starts with the stop signals held (``helper_context``, start method
    ``multiprocessing_context``) until its first act, :func:`die_with_parent`, ignores them;
    this process kills them at its exit (``kill_helpers_at_exit``: Python's exit would send
    them SIGTERM and wait)."""
    kill_helpers_at_exit()
    return {
        "multiprocessing_context": helper_context(multiprocessing_context),
        "worker_init_fn": die_with_parent,
    }


class ResumableDataLoader(StatefulDataLoader):
    """``StatefulDataLoader`` over a :class:`ResumableDistributedSampler` (as its ``sampler``,
    or as its ``batch_sampler`` when that forms the batches), with ``set_epoch``."""

    @property
    def positions(self) -> ResumableDistributedSampler:
        """The sampler that keeps this loader's epoch and position."""
        if isinstance(self.batch_sampler, ResumableDistributedSampler):
            return self.batch_sampler
        return self.sampler  # type: ignore[return-value]

    @property
    def epoch(self) -> int:
        return self.positions.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` runs; call it before each epoch."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer (got {epoch!r})")
        pending = _sampler_state(self.next_iter_state)
        if pending is not None and pending["epoch"] != epoch:
            logger.info(
                "the loaded data position is in epoch %d; starting epoch %d from its beginning",
                pending["epoch"],
                epoch,
            )
            self.next_iter_state = None
        if self._initial_iter_for_state_dict and epoch != self.positions.epoch:
            # state_dict() built (and maybe prefetched) an iterator for the old epoch
            self._iterator = None
            self._initial_iter_for_state_dict = False
        self.positions.set_epoch(epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict``; the next ``iter()`` continues the saved epoch."""
        sampler_state = self._checked_sampler_state(state_dict) if state_dict else None
        super().load_state_dict(state_dict)
        if sampler_state is not None:
            self.positions.set_epoch(int(sampler_state["epoch"]))

    def continue_from(self, state_dict: dict[str, Any]) -> tuple[int, int]:
        """Continue the epoch of ``state_dict``, saved by this kind of loader over another
        number of ranks: the next ``iter()`` deals the items of that epoch not used yet to
        this loader's ranks, each once. Returns (items used, items of the epoch), counted in
        the sampler's units; ValueError says why it cannot."""
        sampler_state = _sampler_state(state_dict)
        if sampler_state is None:
            raise ValueError("its data loader state was not saved by build_dataloader's loader")
        self.next_iter_state = None
        self.set_epoch(int(sampler_state["epoch"]))
        return self.positions.continue_from(sampler_state)

    def _checked_sampler_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_workers = _saved_num_workers(state_dict)
        sampler_state = _sampler_state(state_dict)
        if saved_workers is None or sampler_state is None:
            raise ValueError("data loader state was not saved by build_dataloader's loader")
        if saved_workers != self.num_workers:
            raise ValueError(
                f"data loader state was saved with num_workers={saved_workers} but this loader "
                f"has num_workers={self.num_workers}; resume with num_workers={saved_workers}"
            )
        self.positions.check_compatible(sampler_state)
        return sampler_state


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
    lengths: Sequence[int] | None = None,
    group_size: int | None = None,
    max_tokens: int | None = None,
) -> ResumableDataLoader:
    """A resumable loader over this rank's shard of a map-style ``dataset``.

    With ``lengths`` (each item's length), batches hold items of similar length: HF's grouped
    order with ``group_size`` items per group (default ``batch_size * world_size``), or, with
    ``max_tokens``, batches of at most that many padded tokens (``batch_size`` is then unused);
    forge/data/length_grouping.py has both orders.

    ``drop_last`` applies to the shard (drop the tail that does not split evenly over
    ranks, instead of padding with repeats) and to the batch (drop a last, smaller batch).
    ``collate_fn=None`` uses torch's default collation. ``prefetch_factor`` and
    ``multiprocessing_context`` apply to worker processes (``num_workers > 0``).
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("world_size", world_size, 1)
    _check_int("num_workers", num_workers, 0)
    _check_int("seed", seed, None)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}) (got {rank!r})")
    if num_workers == 0 and (persistent_workers or prefetch_factor or multiprocessing_context):
        raise ValueError(
            "persistent_workers, prefetch_factor and multiprocessing_context need worker "
            "processes; set num_workers > 0 or leave them unset"
        )
    workers: dict[str, Any] = {}
    if num_workers:
        workers = {
            "persistent_workers": persistent_workers,
            "prefetch_factor": prefetch_factor,
            **job_workers(multiprocessing_context),
        }
    if not hasattr(dataset, "__len__") or len(dataset) == 0:  # type: ignore[arg-type]
        raise ValueError(
            "dataset must be a non-empty map-style dataset (with __len__) or a stream (an "
            "IterableDataset: forge.data.streams)"
        )
    if num_workers:  # each batch's random draws follow from the batch (exact resume)
        dataset = WorkerSeededBatches(dataset, seed, rank)
    layout = {"num_replicas": world_size, "rank": rank, "seed": seed, "drop_last": drop_last}
    batching: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last}
    if lengths is not None and max_tokens is not None:
        from forge.data.length_grouping import TokenBudgetBatchSampler

        batching = {
            "batch_sampler": TokenBudgetBatchSampler(
                dataset, lengths, max_tokens=max_tokens, **layout
            )
        }
    elif lengths is not None:
        from forge.data.length_grouping import LengthGroupedSampler

        batching["sampler"] = LengthGroupedSampler(
            dataset, lengths, batch_size=batch_size, group_size=group_size, **layout
        )
    else:
        batching["sampler"] = ResumableDistributedSampler(dataset, shuffle=shuffle, **layout)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = ResumableDataLoader(
            dataset,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            snapshot_every_n_steps=1,
            **batching,
            **workers,  # every step is a valid resume point
        )
    if len(loader) == 0:
        raise ValueError(
            f"the loader has no batches: {len(loader.positions)} samples per rank "
            f"(dataset of {len(dataset)} over world_size={world_size}) < batch_size={batch_size}; "  # type: ignore[arg-type]
            "lower batch_size or set drop_last=False"
        )
    return loader


def loader_epoch_length(loader: StatefulDataLoader) -> int:
    """Batches one rank's loader yields per epoch."""
    return len(loader)


def _sampler_state(state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """The sampler's state inside a ``StatefulDataLoader`` state (either iterator kind)."""
    if not state_dict:
        return None
    main = state_dict.get("_snapshot", {}).get("_main_snapshot", state_dict)
    batch_sampler_state = main.get("_index_sampler_state")
    if isinstance(batch_sampler_state, dict) and "yielded" in batch_sampler_state:
        return batch_sampler_state  # a batch sampler of forge's (it keeps the position)
    iterator_state = main.get("_sampler_iter_state") or {}
    sampler_state = iterator_state.get("sampler_state")
    return sampler_state if isinstance(sampler_state, dict) else None


def saved_position(state_dict: dict[str, Any] | None) -> tuple[int, int, int] | None:
    """The (epoch, start, yielded) a loader state holds, None when it holds none."""
    sampler_state = _sampler_state(state_dict)
    if sampler_state is None:
        return None
    return tuple(int(sampler_state.get(key, 0)) for key in ("epoch", "start", "yielded"))  # type: ignore[return-value]


def _saved_num_workers(state_dict: dict[str, Any]) -> int | None:
    if "_snapshot" in state_dict:
        return state_dict["_snapshot"].get("_main_snapshot", {}).get("_num_workers")
    return 0 if "_num_yielded" in state_dict else None


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer (got {value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value!r})")
