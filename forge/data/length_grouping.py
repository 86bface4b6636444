"""Batches of items of similar length: HF's length-grouped order, and token-budget batches.

Both are :class:`~forge.data.loader.ResumableDistributedSampler` subclasses: the order of an
epoch is a pure function of (seed, epoch, lengths, world size, batch size or budget), and the
position inside it is the base class's ``yielded`` (saved and restored as for any sampler), so
a resume is exact.

``LengthGroupedSampler`` is HF's ``get_length_grouped_indices`` (transformers'
``LengthGroupedSampler``) over the whole dataset, seeded by ``seed + epoch``: a permutation cut
into mega-batches of ``min(50, n // (4 * batch))`` batches, each sorted by length, longest
first, with the longest item of all moved to the first batch. Its ``batch`` is one optimizer
step of every rank (``batch_size * gradient_accumulation_steps * num_replicas``), as HF's
accelerate path groups the step's items before it hands each rank its slice; here each row of
``batch_size * num_replicas`` consecutive items of that order gives rank ``r`` the ``r``-th
``batch_size`` of them. Each rank's batches are then runs of neighbours in a sorted mega-batch
(grouped), and the ranks' batches of one step are neighbours too (similar cost, so no rank
waits for a long one). With one process the order is HF's exactly.

``TokenBudgetBatchSampler`` forms batches whose padded cost (longest item x item count) is at
most ``max_tokens``, as fairseq's ``batch_by_size``: the items sorted by length (longest first;
equal lengths in an order drawn from ``seed + epoch``) are cut greedily into batches, so the
number of batches is the same every epoch (it depends on the sorted lengths alone) and the
schedule's step count holds. Rounds of ``num_replicas`` consecutive batches (similar lengths)
are shuffled with ``seed + epoch``, the round of the longest items first (an out-of-memory shows
at once); rank ``r`` takes the ``r``-th batch of each round, so every rank takes the same number
of batches. A last round with fewer batches than ranks is dropped (``drop_last``) or filled
with the first batches again (as ``DistributedSampler`` pads its shards).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from forge.data.sampler import ResumableDistributedSampler

__all__ = [
    "LengthError",
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "item_lengths",
    "token_batches",
]

#: lengths computed from items, per dataset and column, for as long as the dataset lives
_LENGTHS: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()


class LengthError(ValueError):
    """The items' lengths do not allow the batches asked for (no length, or over the budget)."""


def item_lengths(dataset: Dataset, column: str = "length") -> list[int]:
    """Each item's length: ``column`` of a ``datasets.Dataset`` that has it, else each item's
    ``column`` value or the length of its ``input_ids`` (each item indexed once, then kept in
    memory while the dataset lives). ValueError names ``column`` when neither is there."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list) and column in names:
        return [int(length) for length in dataset[column]]  # type: ignore[index]
    try:
        cached = _LENGTHS.setdefault(dataset, {})
    except TypeError:  # not weakly referable: computed, not kept
        cached = {}
    if column not in cached:
        cached[column] = [
            _length_of(dataset[i], i, column)
            for i in range(len(dataset))  # type: ignore[arg-type]
        ]
    return cached[column]


def _length_of(item: Any, index: int, column: str) -> int:
    if isinstance(item, Mapping):
        if column in item:
            return int(item[column])
        if "input_ids" in item:
            return len(item["input_ids"])
    raise LengthError(
        f"cannot tell the length of item {index}: it has neither a {column!r} value nor "
        "input_ids; set length_column_name to the column that holds each item's length, or "
        "give items input_ids"
    )


class LengthGroupedSampler(ResumableDistributedSampler):
    """Batches of similar lengths in HF's order (module docstring); ``group_size`` is the
    ``batch_size`` HF's grouping is given (one optimizer step of all ranks)."""

    order = "group_by_length"

    def __init__(
        self,
        dataset: Dataset,
        lengths: Sequence[int],
        *,
        batch_size: int,
        group_size: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last
        )
        _check_lengths(lengths, dataset)
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.group_size = group_size or batch_size * num_replicas
        self.order = f"group_by_length:{self.batch_size}x{self.group_size}"
        self.chunk = batch_size  # each rank's batch of a row

    def order_params(self) -> dict[str, Any]:
        return {"group_size": self.group_size}

    def saved_order_params(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if state_dict.get("order_params"):
            return dict(state_dict["order_params"])
        # states before order_params: the group size is the end of the order's name
        return {"group_size": int(str(state_dict["order"]).rpartition("x")[2])}

    def grouped_indices(self, group_size: int | None = None) -> list[int]:
        """All ranks' items of the current epoch, in HF's grouped order (groups of
        ``group_size`` items, default this sampler's)."""
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return list(
            get_length_grouped_indices(
                self.lengths, group_size or self.group_size, generator=generator
            )
        )

    def global_order(self, params: dict[str, Any]) -> list[int]:
        return self.grouped_indices(int(params["group_size"]))


def token_batches(lengths: Sequence[int], max_tokens: int, order: Sequence[int]) -> list[list[int]]:
    """``order`` (longest first) cut greedily into batches of padded cost <= ``max_tokens``."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for index in order:
        longest = lengths[batch[0]] if batch else lengths[index]
        if batch and longest * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(index)
    if batch:
        batches.append(batch)
    return batches


class TokenBudgetBatchSampler(ResumableDistributedSampler):
    """Batches of at most ``max_tokens`` padded tokens (module docstring); a batch sampler:
    each item it yields is a list of indices, and ``len()`` counts this rank's batches."""

    order = "max_tokens_per_batch"
    #: the batches and their rounds depend on the number of ranks
    reshardable = False

    def __init__(
        self,
        dataset: Dataset,
        lengths: Sequence[int],
        *,
        max_tokens: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last
        )
        _check_lengths(lengths, dataset)
        self.lengths = list(lengths)
        self.max_tokens = max_tokens
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        if self.lengths[longest] > max_tokens:
            raise LengthError(
                f"max_tokens_per_batch={max_tokens} is below the length of item {longest} "
                f"({self.lengths[longest]} tokens); raise it to at least the longest item, or "
                "truncate the items"
            )
        count = len(self._batches(list(range(len(self.lengths)))))  # the same every epoch
        whole, rest = divmod(count, num_replicas)
        self.num_samples = whole if drop_last or not rest else whole + 1
        self.order = f"max_tokens_per_batch={max_tokens}"
        if self.num_samples == 0:
            raise LengthError(
                f"max_tokens_per_batch={max_tokens} makes {count} batches, fewer than the "
                f"{num_replicas} processes; lower it or set dataloader_drop_last: false"
            )

    def describe_order(self) -> str:
        return f"batches of at most {self.max_tokens} padded tokens (max_tokens_per_batch)"

    def _batches(self, tiebreak: list[int]) -> list[list[int]]:
        """Batches of the items sorted longest first, equal lengths in ``tiebreak``'s order."""
        order = sorted(tiebreak, key=lambda i: -self.lengths[i])  # stable: keeps the tiebreak
        return token_batches(self.lengths, self.max_tokens, order)

    def __len__(self) -> int:
        return self.num_samples

    def epoch_order(self) -> list[list[int]]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        batches = self._batches(torch.randperm(len(self.lengths), generator=generator).tolist())
        n = self.num_replicas
        wanted = self.num_samples * n
        batches = (batches * (wanted // len(batches) + 1))[:wanted]  # drop or repeat the start
        rounds = [batches[start : start + n] for start in range(0, wanted, n)]
        rest = torch.randperm(len(rounds) - 1, generator=generator).tolist()
        rounds = [rounds[0]] + [rounds[1 + i] for i in rest]  # the longest round first
        return [one[self.rank] for one in rounds]


def _check_lengths(lengths: Sequence[int], dataset: Dataset) -> None:
    if len(lengths) != len(dataset):  # type: ignore[arg-type]
        raise ValueError(
            f"{len(lengths)} lengths for a dataset of {len(dataset)} items"  # type: ignore[arg-type]
        )
