"""A data position saved by one data-parallel size and continued by another
(forge/train/data_position.py, forge/data/sampler.py): the epoch goes on, every item of it used
once across the change, and what cannot continue exactly is refused naming ignore_data_skip.
In-process: each rank's loader is built as that rank builds it; tests/integration/
test_train_resume.py does the same with real processes."""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from forge.checkpoint import CheckpointError
from forge.data.loader import build_dataloader
from forge.train.data_position import DataPosition, StepBatch


class Ids(Dataset):
    """Item ``i`` is ``i`` (and a length, for the length-grouped order)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        return {"id": index, "input_ids": [0] * (1 + (index * 7) % 13)}


def collate(items: list[dict]) -> list[int]:
    return [item["id"] for item in items]


def job(size: int, ranks: int, *, batch: int = 4, accumulation: int = 1, **options):
    """One DataPosition per rank of a job of ``ranks`` data-parallel ranks."""
    dataset = Ids(size)
    if options.pop("grouped", False):
        options["lengths"] = [len(dataset[i]["input_ids"]) for i in range(size)]
        options["group_size"] = batch * accumulation * ranks
    return [
        DataPosition(
            build_dataloader(
                dataset,
                batch_size=batch,
                collate_fn=collate,
                seed=3,
                rank=rank,
                world_size=ranks,
                **options,
            ),
            is_main=rank == 0,
            step_batch=StepBatch(None if "max_tokens" in options else batch, accumulation, ranks),
        )
        for rank in range(ranks)
    ]


#: position -> {epoch: its batches}, held as the loop holds them
_STREAMS: weakref.WeakKeyDictionary[DataPosition, dict[int, Any]] = weakref.WeakKeyDictionary()


def take(positions: list[DataPosition], epoch: int, batches: int | None) -> list[int]:
    """``batches`` more micro-batches of every rank (the rest of the epoch's when None), as
    the loop takes them; their ids."""
    seen = []
    for position in positions:
        streams = _STREAMS.setdefault(position, {})
        if epoch not in streams:
            streams[epoch] = position.epoch_batches(epoch)
        for count, ids in enumerate(streams[epoch], 1):
            seen += ids
            position.took(1)
            if count == batches:
                break
    return seen


def resume(saved: list[DataPosition], ranks: int, **options) -> list[DataPosition]:
    """A job of ``ranks`` ranks resumed from ``saved``'s states, as the checkpoint does it."""
    states = [position.state_dict() for position in saved]
    positions = job(options.pop("size"), ranks, **options)
    for position in positions:
        position.seek(saved[0].epoch, saved[0].batch)
        position.reshape("checkpoint-000004 was written by another size", states)
    return positions


@pytest.mark.parametrize(
    ("before", "after", "taken", "options"),
    [
        (1, 2, 2, {}),
        (2, 1, 3, {}),
        (2, 3, 3, {"shuffle": False}),
        (3, 2, 3, {"drop_last": False}),
        (1, 2, 4, {"grouped": True}),
        (2, 1, 5, {"grouped": True, "drop_last": False}),
    ],
)
def test_the_rest_of_the_epoch_is_dealt_each_item_once(before, after, taken, options):
    size = 96
    first = job(size, before, **options)
    used = take(first, 0, taken)
    positions = resume(first, after, size=size, **options)
    rest = take(positions, 0, None)
    counts = Counter(used + rest)
    assert len(used) == taken * 4 * before
    assert max(counts.values()) == 1, "an item was used twice across the change"
    assert len(counts) == size  # whole batches on both sides here: nothing dropped
    for position in positions:  # the epoch ends where a straight run's would
        assert position.batch == len(position.loader)
    # the next epoch is the new size's own, whole
    assert take(positions, 1, None) == take(job(size, after, **options), 1, None)


def test_a_change_and_a_change_back_in_one_epoch_use_each_item_once():
    size = 100
    first = job(size, 1, batch=3)
    used = take(first, 0, 5)
    second = resume(first, 2, size=size, batch=3)
    used += take(second, 0, 4)
    third = resume(second, 1, size=size, batch=3)  # another change, inside the continued epoch
    used += take(third, 0, None)
    counts = Counter(used)
    assert max(counts.values()) == 1
    assert size - len(counts) < 3  # only a last, short batch is dropped (drop_last)


def test_a_same_size_resume_inside_a_continued_epoch_is_exact():
    size = 96
    first = job(size, 1)
    take(first, 0, 2)
    second = resume(first, 2, size=size)
    take(second, 0, 3)
    states, batch = [position.state_dict() for position in second], second[0].batch
    straight = take(second, 0, None)
    again = job(size, 2)
    for position, state in zip(again, states, strict=True):
        position.seek(0, batch)
        position.load_state_dict(state)
    assert take(again, 0, None) == straight


def test_the_log_line_says_the_global_batch_and_how_to_keep_it(caplog):
    first = job(96, 1, batch=4, accumulation=2)
    take(first, 0, 2)
    with caplog.at_level(logging.WARNING, logger="forge.train.data_position"):
        resume(first, 2, size=96, batch=4, accumulation=2)
    (line,) = [record.getMessage() for record in caplog.records]
    assert "epoch 0 continues: 8 of its 96 items were used, the other 88" in line
    assert "the global batch was 8 (4 x 2 x 1), it is now 16 (4 x 2 x 2)" in line
    assert "trainer.args.gradient_accumulation_steps=1" in line
    assert "trainer.args.per_device_train_batch_size=2" in line


def test_token_budget_batches_on_another_size_are_refused_naming_ignore_data_skip():
    options = {"grouped": True, "max_tokens": 40}
    first = job(96, 1, **options)
    take(first, 0, 2)
    with pytest.raises(CheckpointError, match=r"cannot be dealt to 2 .*ignore_data_skip: true"):
        resume(first, 2, size=96, **options)


def test_an_epoch_boundary_starts_the_next_epoch_whole():
    first = job(96, 2)
    take(first, 0, None)
    for position in first:
        position.end_epoch()
    positions = resume(first, 1, size=96)
    assert sorted(take(positions, 1, None)) == list(range(96))


def test_the_global_order_does_not_depend_on_the_number_of_ranks():
    positions = job(50, 1)[0].loader.positions
    other = job(50, 5)[0].loader.positions
    positions.set_epoch(2), other.set_epoch(2)
    assert positions.global_order({}) == other.global_order({})
    assert positions.global_order({}) != list(range(50))
    assert torch.equal(torch.tensor(sorted(positions.global_order({}))), torch.arange(50))


def test_a_position_not_restored_restarts_its_epoch_and_says_so(caplog):
    """ignore_data_skip (or restore_dataloader_state: false): the inexact way, said."""
    position = job(96, 2)[0]
    position.seek(0, 5)  # the trainer's counters: 5 micro-batches into epoch 0
    with caplog.at_level(logging.WARNING, logger="forge.train.data_position"):
        position.restart_epoch_unless_restored()
    assert position.batch == 0
    (line,) = [record.getMessage() for record in caplog.records]
    assert "trainer.args.ignore_data_skip" in line and "epoch 0 restarts" in line
