"""Length-grouped and token-budget batches (forge/data/length_grouping.py): HF's order on one
process, little padding, a budget never exceeded, the same number of batches on every rank and
every epoch, and an exact resume from a state taken mid-epoch."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import Dataset

from forge.data.length_grouping import (
    LengthError,
    LengthGroupedSampler,
    TokenBudgetBatchSampler,
    item_lengths,
)
from forge.data.loader import build_dataloader


def lengths_of(n: int = 600, seed: int = 0) -> list[int]:
    draw = random.Random(seed)
    return [draw.randint(2, 64) for _ in range(n)]


class Sequences(Dataset):
    """Items of the given lengths; counts the items fetched."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.fetched = lengths, 0

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        self.fetched += 1
        return {"input_ids": list(range(self.lengths[index]))}


def sizes(items: list[dict]) -> list[int]:
    return [len(item["input_ids"]) for item in items]


def padding(batches: list[list[int]]) -> float:
    """The fraction of a padded batch's positions that are padding, over all batches."""
    real = sum(sum(batch) for batch in batches)
    return 1 - real / sum(max(batch) * len(batch) for batch in batches)


def loader(items: list[int], **kwargs):
    """A loader over items of lengths ``items`` whose batches are the items' lengths."""
    kwargs.setdefault("batch_size", 4)
    return build_dataloader(Sequences(items), collate_fn=sizes, seed=7, **kwargs)


def test_one_process_order_is_hfs():
    from transformers.trainer_pt_utils import LengthGroupedSampler as HFSampler

    lengths = lengths_of()
    for epoch in (0, 3):
        ours = LengthGroupedSampler(Sequences(lengths), lengths, batch_size=4, group_size=8, seed=7)
        ours.set_epoch(epoch)
        generator = torch.Generator().manual_seed(7 + epoch)  # DistributedSampler's seed
        assert [int(i) for i in ours] == list(HFSampler(8, lengths=lengths, generator=generator))


def test_grouped_batches_hold_much_less_padding_than_random_ones():
    lengths = lengths_of()
    random_padding = padding(list(loader(lengths)))
    grouped = padding(list(loader(lengths, lengths=lengths)))
    budget = padding(list(loader(lengths, lengths=lengths, max_tokens=256)))
    assert random_padding > 0.3 and grouped < 0.05 and budget < 0.05, (random_padding, grouped)


def test_every_rank_gets_grouped_batches_of_every_item_once():
    lengths = lengths_of(601)
    ranks = [loader(lengths, lengths=lengths, rank=r, world_size=2, drop_last=True) for r in (0, 1)]
    for one in ranks:
        one.set_epoch(2)
    batches = [list(one) for one in ranks]
    assert len(batches[0]) == len(batches[1]) == len(ranks[0])
    assert all(padding(b) < 0.05 for b in batches)
    assert max(batches[0][0]) == max(lengths)  # the longest batch first (an OOM shows at once)
    seen = [i for one in ranks for i in one.positions.epoch_order()]
    assert len(seen) == len(set(seen)) == 600  # disjoint shards; one item dropped


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_token_budget_batches(world_size):
    lengths = lengths_of()
    ranks = [
        loader(
            lengths, lengths=lengths, max_tokens=200, rank=r, world_size=world_size, drop_last=False
        )
        for r in range(world_size)
    ]
    counts = set()
    for epoch in range(3):
        epoch_batches = []
        for one in ranks:
            one.set_epoch(epoch)
            epoch_batches.append(list(one))
        counts |= {len(b) for b in epoch_batches} | {len(one) for one in ranks}
        every = [batch for rank in epoch_batches for batch in rank]
        assert all(max(batch) * len(batch) <= 200 for batch in every)
        indices = {i for one in ranks for batch in one.positions.epoch_order() for i in batch}
        assert indices == set(range(len(lengths)))  # every item, each epoch
        assert max(epoch_batches[0][0]) == max(lengths)
    assert len(counts) == 1  # the same count on every rank and every epoch
    first, second = (
        TokenBudgetBatchSampler(Sequences(lengths), lengths, max_tokens=200, seed=7)
        for _ in range(2)
    )
    second.set_epoch(1)
    assert first.epoch_order() != second.epoch_order()  # other batches in another epoch


@pytest.mark.parametrize("max_tokens", [None, 200], ids=["grouped", "budget"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_gives_the_rest_of_the_epoch(max_tokens, workers):
    lengths = lengths_of(200)

    def build():
        return loader(lengths, lengths=lengths, max_tokens=max_tokens, num_workers=workers)

    first = build()
    first.set_epoch(1)
    batches = iter(first)
    taken = [next(batches) for _ in range(5)]
    state = first.state_dict()
    rest = list(batches)
    again = build()
    again.load_state_dict(state)
    again.set_epoch(1)
    assert len(taken) == 5 and list(again) == rest
    plain = loader(
        lengths, num_workers=workers
    )  # a run saved with another order is not resumed by this one
    with pytest.raises(ValueError, match="order"):
        plain.load_state_dict(state)


def test_lengths_come_from_the_column_else_from_input_ids_once():
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": [[1], [1, 2]], "n": [5, 9]})
    assert item_lengths(table, "n") == [5, 9]
    items = Sequences([3, 1, 2])
    assert item_lengths(items) == item_lengths(items) == [3, 1, 2]
    assert items.fetched == 3  # computed once, then kept for the run


def test_items_without_lengths_or_over_the_budget_are_refused():
    with pytest.raises(LengthError, match="length_column_name"):
        item_lengths([{"text": "no ids"}], "length")
    with pytest.raises(LengthError, match="max_tokens_per_batch=10 is below the length of item 1"):
        TokenBudgetBatchSampler(Sequences([3, 12]), [3, 12], max_tokens=10)


@pytest.mark.parametrize(
    ("saved", "other", "differs"),
    [
        ({"batch_size": 4}, {"batch_size": 8}, "group_by_length:4x4"),
        ({"batch_size": 4}, {"batch_size": 4, "group_size": 16}, "group_by_length:4x4"),
        ({"max_tokens": 200}, {"max_tokens": 300}, "max_tokens_per_batch=200"),
    ],
    ids=["batch", "group", "budget"],
)
def test_a_state_names_its_grouping_and_another_grouping_is_refused(saved, other, differs):
    """Another batch size, group size or token budget forms other batches of the epoch: the
    saved position would point into them, so the resume is refused, naming the saved kind."""
    lengths = lengths_of(100)
    first = loader(lengths, lengths=lengths, **saved)
    batches = iter(first)
    next(batches)
    state = first.state_dict()
    with pytest.raises(ValueError, match=f"order='{differs}'"):
        loader(lengths, lengths=lengths, **other).load_state_dict(state)
    again = loader(lengths, lengths=lengths, **saved)
    again.load_state_dict(state)  # the same grouping resumes
    assert list(again) == list(batches)
