"""The sampler behind forge's loaders: ``DistributedSampler``'s order and shards with a
position that is saved and restored exactly (forge/data/loader.py says what it fixes in
torchdata's), and the epoch-tagged index it yields. forge/data/length_grouping.py builds its
grouped orders on it.

An epoch's order is one sequence for all ranks (its *global order*: a function of the seed, the
epoch, the dataset and the sampler's ``order_params``, such as the length-grouped order's group
size; a continued epoch keeps the saved job's), dealt to the ranks a chunk at a time
(``deal``). Every rank takes as many units as the others, so after each rank took ``y`` of
them the first ``num_replicas * y`` units of the global order are used: that count is the
epoch's position for any number of ranks, and a job of another data-parallel size continues
the epoch from it (``continue_from``), dealing only the units not used yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

_STATE_KEYS = ("epoch", "yielded", "seed", "shuffle", "num_replicas", "drop_last", "dataset_size")
#: what a resumed sampler must share with the saved one ("order": how batches are formed;
#: states saved before it existed were all "dataset" order)
_LAYOUT_KEYS = ("seed", "shuffle", "num_replicas", "drop_last", "dataset_size", "order")


class EpochIndex(int):
    """A dataset index that carries the epoch it was drawn in, so a loader's worker process
    knows the epoch of the batch it fetches (a persistent worker keeps the dataset it was
    started with, whatever epoch the loader is in since)."""

    epoch: int

    def __new__(cls, value: int, epoch: int) -> EpochIndex:
        index = super().__new__(cls, value)
        index.epoch = epoch
        return index

    def __reduce__(self) -> tuple[Any, ...]:
        return (EpochIndex, (int(self), self.epoch))


def deal(
    units: list[Any], *, num_replicas: int, rank: int, chunk: int = 1, drop_last: bool
) -> list[Any]:
    """Rank ``rank``'s share of ``units`` (all ranks' units of an epoch, in order).

    The units are cut to a multiple of ``num_replicas`` (``drop_last``) or padded to one by
    repeating them from the start, as ``DistributedSampler`` does; then each row of
    ``chunk * num_replicas`` consecutive units gives rank ``r`` its ``r``-th ``chunk``, and a
    last row shorter than that is split evenly. So after each rank took ``y`` units, the first
    ``num_replicas * y`` of the (padded) units are used, whatever ``y``.
    """
    n = num_replicas
    if drop_last:
        units = units[: len(units) // n * n]
    elif units and len(units) % n:
        wanted = -(-len(units) // n) * n
        units = (units * (wanted // len(units) + 1))[:wanted]
    row = chunk * n
    whole = len(units) // row * row
    mine: list[Any] = []
    for start in range(rank * chunk, whole, row):
        mine += units[start : start + chunk]
    tail = units[whole:]
    share = len(tail) // n
    return mine + tail[rank * share : (rank + 1) * share]


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (same order and shards) whose position can be saved and restored.

    The order of epoch ``e`` is a permutation seeded by ``seed + e`` (or the identity when
    ``shuffle`` is False); rank ``r`` of ``num_replicas`` takes every ``num_replicas``-th index
    from ``r``. With ``drop_last`` the tail that does not divide evenly is dropped, so shards
    are disjoint; without it, the first indices are repeated to pad every shard to one length.

    Subclasses change the global order (``global_order``, a pure function of the epoch and
    of ``order_params``) and the ``chunk`` each rank takes in turn, and keep this position and
    its state; the units of the order may be indices or whole batches (lists of indices, for a
    batch sampler). One whose order cannot be continued by another number of ranks says so
    with ``reshardable = False``.
    """

    #: names the kind of order in the state, so a resume with another kind is refused
    order = "dataset"
    #: consecutive units of the global order each rank takes in turn
    chunk = 1
    #: whether another number of ranks can continue an epoch of this order
    reshardable = True

    def __init__(
        self,
        dataset: Dataset,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.yielded = 0
        self._resume_at: int | None = None
        #: (epoch, units of its global order used before this job, order_params) of an
        #: epoch continued from a job of another size
        self._continued: tuple[int, int, dict[str, Any]] | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.yielded = 0
            self._resume_at = None
        super().set_epoch(epoch)

    def order_params(self) -> dict[str, Any]:
        """What fixes an epoch's global order besides the seed, the epoch and the dataset."""
        return {}

    def global_order(self, params: dict[str, Any]) -> list[Any]:
        """All ranks' units of the current epoch, in order (before ``deal`` pads or cuts)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))  # type: ignore[arg-type]
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]

    def epoch_order(self) -> list[Any]:
        """What this rank takes in the current epoch, in order: its share of the units of the
        global order not used yet (all of them, unless the epoch was continued)."""
        start, params = self._dealing()
        return deal(
            self.global_order(params)[start:],
            num_replicas=self.num_replicas,
            rank=self.rank,
            chunk=self.chunk,
            drop_last=self.drop_last,
        )

    def _dealing(self) -> tuple[int, dict[str, Any]]:
        """The current epoch's units used before this job, and its order's parameters."""
        if self._continued is not None and self._continued[0] == self.epoch:
            return self._continued[1], self._continued[2]
        return 0, self.order_params()

    def __iter__(self) -> Iterator[Any]:
        items = self.epoch_order()
        start, self._resume_at = self._resume_at or 0, None
        self.yielded = min(start, len(items))
        return self._iterate(items, self.yielded)

    def _iterate(self, items: list[Any], start: int) -> Iterator[Any]:
        for position in range(start, len(items)):
            self.yielded = position + 1
            item = items[position]
            if isinstance(item, list):  # a batch
                yield [EpochIndex(index, self.epoch) for index in item]
            else:
                yield EpochIndex(item, self.epoch)

    def state_dict(self) -> dict[str, Any]:
        start, params = self._dealing()
        return {
            "start": start,
            "order_params": params,
            "epoch": self.epoch,
            "yielded": self.yielded,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "drop_last": self.drop_last,
            "dataset_size": len(self.dataset),  # type: ignore[arg-type]
            "order": self.order,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict``'s epoch and position; the next ``iter()`` starts there."""
        self.check_compatible(state_dict)
        epoch = int(state_dict["epoch"])
        super().set_epoch(epoch)
        self.yielded = int(state_dict["yielded"])
        self._resume_at = self.yielded
        start = int(state_dict.get("start", 0))  # states before it: epochs never continued
        self._continued = (epoch, start, self.saved_order_params(state_dict))

    def describe_order(self) -> str:
        """The order's kind, for messages."""
        return "order"

    def saved_order_params(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The order parameters of the epoch ``state_dict`` is in."""
        return dict(state_dict.get("order_params") or self.order_params())

    def continue_from(self, state_dict: dict[str, Any]) -> tuple[int, int]:
        """Continue the epoch of ``state_dict``, a state of this kind of sampler saved by
        another number of ranks: the next ``iter()`` deals the units of that epoch's global
        order not used yet to this sampler's ranks. Returns (units used, units of the epoch);
        ValueError says why the state cannot be continued."""
        if not self.reshardable:
            raise ValueError(f"its {self.describe_order()} depend on the number of ranks")
        kind = {**state_dict, "order": str(state_dict.get("order", "dataset")).split(":")[0]}
        self._check_same(kind, ("seed", "shuffle", "drop_last", "dataset_size", "order"))
        epoch = int(state_dict["epoch"])
        self.set_epoch(epoch)
        params = self.saved_order_params(state_dict)
        total = len(self.global_order(params))
        used = int(state_dict.get("start", 0)) + int(state_dict["num_replicas"]) * int(
            state_dict["yielded"]
        )
        used = min(used, total)  # past the end: into units repeated to pad the last row
        self.yielded, self._resume_at = 0, None
        self._continued = (epoch, used, params)
        return used, total

    def check_compatible(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError unless ``state_dict`` was saved by a sampler with this layout."""
        self._check_same(state_dict, _LAYOUT_KEYS)
        if not 0 <= int(state_dict["yielded"]) <= self.num_samples:
            raise ValueError(
                f"data loader state has yielded={state_dict['yielded']} outside "
                f"[0, {self.num_samples}]"
            )

    def _check_same(self, state_dict: dict[str, Any], keys: tuple[str, ...]) -> None:
        """Raise ValueError unless ``state_dict`` is forge's and has this sampler's ``keys``
        (``order`` compared by its kind when the state's is only a kind)."""
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"data loader state lacks {missing}; it was not saved by forge")
        mine = self.state_dict()
        if ":" not in str(state_dict.get("order", "")):
            mine["order"] = str(mine["order"]).split(":")[0]
        for key in keys:
            saved = state_dict.get(key, "dataset")  # only "order" may be absent
            if saved != mine[key]:
                raise ValueError(
                    f"it was saved with {key}={saved!r} but this one has {key}={mine[key]!r}; "
                    f"resume with the same {key}"
                )
