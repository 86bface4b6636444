"""The sampler behind forge's loaders: ``DistributedSampler``'s order and shards with a
position that is saved and restored exactly (forge/data/loader.py says what it fixes in
torchdata's), and the epoch-tagged index it yields. forge/data/length_grouping.py builds its
grouped orders on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (same order and shards) whose position can be saved and restored.

    The order of epoch ``e`` is a permutation seeded by ``seed + e`` (or the identity when
    ``shuffle`` is False); rank ``r`` of ``num_replicas`` takes every ``num_replicas``-th index
    from ``r``. With ``drop_last`` the tail that does not divide evenly is dropped, so shards
    are disjoint; without it, the first indices are repeated to pad every shard to one length.

    Subclasses change the order (``epoch_order``: what this rank takes in the current epoch,
    a pure function of the layout and the epoch) and keep this position and its state; the
    items of the order may be indices or whole batches (lists of indices, for a batch sampler).
    """

    #: names the kind of order in the state, so a resume with another kind is refused
    order = "dataset"

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

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.yielded = 0
            self._resume_at = None
        super().set_epoch(epoch)

    def epoch_order(self) -> list[Any]:
        """What this rank takes in the current epoch, in order."""
        return list(super().__iter__())

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
        return {
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
        super().set_epoch(int(state_dict["epoch"]))
        self.yielded = int(state_dict["yielded"])
        self._resume_at = self.yielded

    def check_compatible(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError unless ``state_dict`` was saved by a sampler with this layout."""
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"data loader state lacks {missing}; it was not saved by forge")
        mine = self.state_dict()
        for key in _LAYOUT_KEYS:
            saved = state_dict.get(key, "dataset")  # only "order" may be absent
            if saved != mine[key]:
                raise ValueError(
                    f"cannot resume the data loader: it was saved with {key}={saved!r} "
                    f"but this one has {key}={mine[key]!r}; resume with the same {key}"
                )
        if not 0 <= int(state_dict["yielded"]) <= self.num_samples:
            raise ValueError(
                f"data loader state has yielded={state_dict['yielded']} outside "
                f"[0, {self.num_samples}]"
            )
