"""The two loaders a trainer reads, from plain arguments (no trainer, no training arguments).

The training loader is shuffled (or sequential), sharded over the data-parallel ranks and
resumable (``build_dataloader``); the evaluation loader gives rank ``r`` of ``n`` the items
``r, r + n, ...`` in order, each item once, so gathered predictions go back into dataset order.
Both apply ``remove_unused_columns`` when given the model's inputs (``ModelInputs``), and run
their workers as torch's ``DataLoader`` keywords from ``worker_settings`` say.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

from forge.data.collator import KeepItems
from forge.data.columns import ModelInputs, keep_model_inputs
from forge.data.loader import (
    ResumableDataLoader,
    WorkerSeededBatches,
    build_dataloader,
    job_workers,
)
from forge.data.streams import StreamLoader, build_stream_loader, is_stream, read_stream

__all__ = ["StridedSampler", "build_eval_loader", "build_train_loader", "worker_settings"]

Collator = Callable[[list[Any]], Any]


def worker_settings(
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
) -> dict[str, Any]:
    """torch ``DataLoader`` keywords for the loaders' worker processes (HF's
    ``dataloader_*`` arguments); the settings of worker processes only when there are some,
    as torch refuses them otherwise."""
    settings: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers:
        settings.update(
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
        )
    return settings


def build_train_loader(
    dataset: Dataset,
    collator: Collator | None,
    *,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    drop_last: bool = False,
    workers: Mapping[str, Any] | None = None,
    inputs: ModelInputs | None = None,
    description: str = "train",
    lengths: Sequence[int] | None = None,
    group_size: int | None = None,
    max_tokens: int | None = None,
    stream_shuffle_buffer: int = 1000,
    keep_items: bool = False,
) -> ResumableDataLoader | StreamLoader:
    """This data-parallel rank's resumable loader over ``dataset``; with ``inputs``, the
    columns the model does not take are dropped first. ``lengths`` (each item's, from
    ``item_lengths`` before the columns are dropped) groups the batches by length, with
    ``group_size`` items per group, or into batches of at most ``max_tokens`` padded tokens
    (``build_dataloader``). A stream (``is_stream``: an iterable dataset) is read endlessly,
    sharded over ranks and workers, through a shuffle buffer of ``stream_shuffle_buffer`` items
    (forge/data/streams.py). ``keep_items``: each map-style batch keeps its items
    (``KeepItems``)."""
    if inputs is not None:
        dataset, collator = keep_model_inputs(dataset, collator, inputs, description)
    if is_stream(dataset):
        if lengths is not None or max_tokens is not None:
            raise ValueError(
                "batches grouped by length (group_by_length, max_tokens_per_batch) need each "
                "item's length up front, which a stream does not have"
            )
        settings = dict(workers or {})
        if settings.get("num_workers"):
            settings.update(job_workers(settings.get("multiprocessing_context")))
        return build_stream_loader(
            dataset,
            batch_size=batch_size,
            collate_fn=collator,
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            shuffle_buffer=stream_shuffle_buffer,
            **settings,
        )
    if keep_items:
        collator = KeepItems(collator)
    return build_dataloader(
        dataset,
        batch_size=batch_size,
        collate_fn=collator,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        lengths=lengths,
        group_size=group_size,
        max_tokens=max_tokens,
        **(workers or {}),
    )


def build_eval_loader(
    dataset: Dataset,
    collator: Collator | None,
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    workers: Mapping[str, Any] | None = None,
    inputs: ModelInputs | None = None,
    description: str = "eval",
    seed: int = 0,
    max_items: int | None = None,
) -> DataLoader:
    """This data-parallel rank's share of ``dataset``, in order: items ``rank, rank +
    world_size, ...``, each item once (``StridedSampler``). Worker processes draw each batch's
    random numbers from ``seed`` and the batch (``WorkerSeededBatches``): every evaluation of a
    run sees the same batches. A stream is read once, in its order, into a list (its first
    ``max_items`` items where given: ``max_eval_batches`` bounds it), then shared the same way."""
    if is_stream(dataset):
        dataset = read_stream(dataset, max_items)
        if not dataset:
            raise ValueError(f"the {description} stream yielded no item")
    if inputs is not None:
        dataset, collator = keep_model_inputs(dataset, collator, inputs, description)
    workers = dict(workers or {})
    if workers.get("num_workers"):
        dataset = WorkerSeededBatches(dataset, seed, rank)
        workers.update(job_workers(workers.get("multiprocessing_context")))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=StridedSampler(len(dataset), rank, world_size),
        collate_fn=collator,
        **workers,
    )


class StridedSampler(Sampler[int]):
    """Rank ``rank`` of ``world_size`` takes items ``rank, rank + world_size, ...``: every item
    once, none repeated (shards differ by at most one item)."""

    def __init__(self, length: int, rank: int = 0, world_size: int = 1) -> None:
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))
