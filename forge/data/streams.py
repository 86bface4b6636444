"""Streams (iterable datasets) as training data: sharded over ranks and loader workers, shuffled
from the seed, and resumable exactly, in constant time.

A stream is read as *shards* (files, or one shard for a stream that has no notion of them)
through a :class:`StreamSource` (forge/data/stream_sources.py): a ``datasets.IterableDataset``,
a torch ``IterableDataset`` or one's own reader of shards (:class:`ShardReader`).
Every (rank, loader worker) pair is a *slot*; slot ``s`` of ``S`` reads, in epoch ``e``:

* by shards, where the shard count is a multiple of ``S`` (or 8 x ``S`` and more): the shards
  ``order[s::S]`` of the epoch's shard order (a permutation seeded by ``seed + e`` when
  shuffling);
* by items otherwise: every shard in the epoch's order, keeping items ``s, s + S, ...``
  (as ``datasets.distributed.split_dataset_by_node`` and HF's ``IterableDatasetShard`` do).

Every item of an epoch reaches exactly one slot. A slot reads its epochs one after the other
(an endless stream; the trainer stops at ``max_steps``), through a seeded shuffle buffer whose
contents are part of the slot's state. The state of a slot — epoch, shard, the position inside
the shard (the source's own ``state_dict()`` where it has one), the items it has seen, the
buffer — is what ``StatefulDataLoader`` saves per worker; a resume seeks the shard and goes on,
at a cost bounded by one shard's read (a source without state re-reads the current shard up
to the position; a torch stream without ``state_dict`` is one shard, so it re-reads from its
start, and says so).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from forge.data.stream_sources import (
    ShardCursor,
    ShardReader,
    StreamSource,
    is_stream,
    stream_source,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ShardCursor",
    "ShardReader",
    "StreamSource",
    "ShardedStream",
    "StreamError",
    "StreamLoader",
    "build_stream_loader",
    "is_stream",
    "read_stream",
    "stream_source",
]


class StreamError(RuntimeError):
    """A stream that cannot be read: names the shard and the item where it failed."""


# --------------------------------------------------------------------------- slots
def _draw(seed: int, epoch: int, slot: int, draw: int, bound: int) -> int:
    """A uniform integer in [0, bound) from a counter-based hash: the buffer's generator has no
    state but the count of draws."""
    text = f"{seed}:{epoch}:{slot}:{draw}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") % bound


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's shard order: a permutation seeded by ``seed + epoch`` (or the identity)."""
    import torch

    if not shuffle:
        return list(range(num_shards))
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_shards, generator=generator).tolist()


class SlotStream:
    """What one slot (a rank's loader worker, or the rank's main process) reads, epoch after
    epoch, and where it is: a torchdata ``Stateful`` iterator, restored before its first item."""

    def __init__(self, stream: ShardedStream, slot: int, slots: int) -> None:
        self.stream, self.slot, self.slots = stream, slot, slots
        self.epoch = stream.start_epoch
        self.shard = 0  # index into this slot's shards of the epoch
        self.position: Any = None  # inside the current shard
        self.seen = 0  # items of the epoch read before the current one (the item split)
        self.buffer: list[Any] = []
        self._plain: list[Any] = []  # the buffer's items as plain values (None: not yet)
        self.draws = 0
        self.yielded = 0  # items this slot gave out in the epoch
        self.restored = False
        # shards dealt to this slot from a position saved by another count of readers
        # (``deal_positions``): each {"epoch", "shard", "position"}, read before its own
        self.pending: list[dict[str, Any]] = []
        self.carried = False  # its epoch is one continued from another count of readers
        self._items: Iterator[Any] | None = None
        self._cursor: ShardCursor | None = None

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        position, pending = self.position, copy.deepcopy(self.pending)
        if self._cursor is not None:  # inside a dealt shard while any is pending
            where = self._cursor.position()
            if pending:
                pending[0]["position"] = copy.deepcopy(where)
            else:
                position = where
        return {
            "epoch": self.epoch,
            "shard": self.shard,
            "position": copy.deepcopy(position),
            "seen": self.seen,
            "buffer": self._packed_buffer(),
            "draws": self.draws,
            "yielded": self.yielded,
            "slot": self.slot,
            "slots": self.slots,
            "split": "shards" if self.stream.by_shards(self.slots) else "items",
            "source": self.stream.source.state(),
            "pending": pending,
            "carried": self.carried,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("slot"), state.get("slots")) != (self.slot, self.slots):
            raise ValueError(
                f"the stream position was saved for slot {state.get('slot')} of "
                f"{state.get('slots')} (ranks x loader workers), this is slot {self.slot} of "
                f"{self.slots}"
            )
        self.epoch, self.shard = int(state["epoch"]), int(state["shard"])
        self.position, self.seen = state["position"], int(state["seen"])
        self.buffer, self.draws = _unpacked(state["buffer"]), int(state["draws"])
        self._plain = list(state["buffer"])
        self.yielded, self.restored = int(state["yielded"]), True
        self.pending = copy.deepcopy(list(state.get("pending") or []))
        self.carried = bool(state.get("carried", False))
        self.stream.source.restore(state.get("source"))
        self._items = None

    def carry(self, dealt: dict[str, Any]) -> None:
        """Start from what ``deal_positions`` dealt this slot: the saved epoch's shards it
        reads first (``pending``) and the saved shuffle buffers' items it was given; then on
        with the next epoch, as this job's readers split it."""
        self.epoch, self.pending = int(dealt["epoch"]), copy.deepcopy(list(dealt["pending"]))
        self.shard = len(self._shards())  # its own shards of the saved epoch: none
        self.position, self.seen, self.draws, self.yielded = None, 0, 0, 0
        self.buffer, self._plain = _unpacked(dealt["buffer"]), list(dealt["buffer"])
        self.carried = self.restored = True
        self._items = None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> SlotStream:
        return self

    def __next__(self) -> Any:
        if self._items is None:
            self._items = self._run()
        return next(self._items)

    def _run(self) -> Iterator[Any]:
        stream = self.stream
        if self.restored and not stream.source.stateful and self.position:
            logger.info(
                "resuming the stream (%s has no state_dict): re-reading %s items of %s",
                type(stream.dataset).__name__,
                self.position,
                stream.source.shard_name(self._shards()[self.shard])
                if self.shard < len(self._shards())
                else "its current shard",
            )
        while True:
            given, carried = self.yielded, self.carried
            yield from self._epoch()
            if self.yielded == 0 and given == 0 and not carried:
                return  # nothing for this slot in a whole epoch: it ends (others go on)
            self.epoch += 1
            self.shard, self.position, self.seen, self.draws, self.yielded = 0, None, 0, 0, 0
            self.carried = False

    def _shards(self) -> list[int]:
        stream = self.stream
        order = shard_order(stream.source.num_shards, stream.seed, self.epoch, stream.shuffle)
        if stream.by_shards(self.slots):
            return order[self.slot :: self.slots]
        return order

    def _epoch(self) -> Iterator[Any]:
        stream, shards = self.stream, self._shards()
        size = stream.shuffle_buffer if stream.shuffle else 0
        while self.pending:  # shards dealt from another count of readers, read whole
            piece = self.pending[0]
            cursor = self._open(piece["shard"], piece["epoch"], piece["position"])
            yield from self._read(cursor, piece["shard"], False, size)
            self._cursor = None
            self.pending.pop(0)
        by_items = not stream.by_shards(self.slots)
        while self.shard < len(shards):
            cursor = self._open(shards[self.shard], self.epoch, self.position)
            yield from self._read(cursor, shards[self.shard], by_items, size)
            self._cursor, self.position = None, None
            self.shard += 1
        while self.buffer:  # the epoch's last items, in a seeded order
            yield self._take(None)

    def _read(self, cursor: ShardCursor, shard: int, by_items: bool, size: int) -> Iterator[Any]:
        """The items of one shard this slot keeps, through the shuffle buffer."""
        name, read = self.stream.source.shard_name(shard), 0
        while True:
            try:
                item = next(cursor.items)
            except StopIteration:
                return
            except Exception as exc:
                where = "resumed " if self.restored else ""
                raise StreamError(
                    f"reading {name} (epoch {self.epoch}, after {read} item(s) of this "
                    f"{where}read of it): {type(exc).__name__}: {exc}"
                ) from exc
            read += 1
            index, self.seen = self.seen, self.seen + 1
            if by_items and index % self.slots != self.slot:
                continue
            if size <= 1 and not self.buffer:
                self.yielded += 1
                yield item
                continue
            if len(self.buffer) < size:
                self.buffer.append(item)
                self._plain.append(None)
                continue
            yield self._take(item)

    def _take(self, replacement: Any) -> Any:
        pick = _draw(self.stream.seed, self.epoch, self.slot, self.draws, len(self.buffer))
        self.draws += 1
        self.yielded += 1
        item = self.buffer[pick]
        if replacement is None:
            self.buffer[pick], self._plain[pick] = self.buffer[-1], self._plain[-1]
            self.buffer.pop()
            self._plain.pop()
        else:
            self.buffer[pick], self._plain[pick] = replacement, None
        return item

    def _packed_buffer(self) -> list[Any]:
        """The buffer as plain values (``_plain``), each item converted once."""
        plain = self._plain
        for index, value in enumerate(plain):
            if value is None:
                plain[index] = _plain(self.buffer[index])
        return list(plain)

    def _open(self, shard: int, epoch: int, position: Any) -> ShardCursor:
        stream = self.stream
        try:
            cursor = stream.source.open(shard, epoch, position)
        except Exception as exc:
            raise StreamError(
                f"opening {stream.source.shard_name(shard)}: {type(exc).__name__}: {exc}"
            ) from exc
        self._cursor = cursor
        return cursor


def _plain(value: Any) -> Any:
    """An item as plain values: each tensor as its dtype, shape and bytes. A worker sends its
    state through a pipe with every snapshot, and a thousand tensors sent as tensors (one
    shared-memory handle each) cost a second; as bytes, milliseconds."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        return {_TENSOR: [str(data.dtype).removeprefix("torch."), list(data.shape), _bytes(data)]}
    if isinstance(value, dict):
        return {key: _plain(inner) for key, inner in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(inner) for inner in value)
    return value


def _bytes(data: torch.Tensor) -> bytes:
    # flattened first: a 0-d tensor (a scalar label) has no last dimension to view as bytes
    return data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""


def _unpacked(items: list[Any]) -> list[Any]:
    return [_restored(item) for item in items]


def _restored(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value and len(value) == 1:
            dtype, shape, data = value[_TENSOR]
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            kind = getattr(torch, dtype)
            if flat is None:
                return torch.empty(shape, dtype=kind)
            return flat.view(kind).reshape(shape).clone()
        return {key: _restored(inner) for key, inner in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(inner) for inner in value)
    return value


_TENSOR = "__forge_tensor__"


class ShardedStream(IterableDataset):
    """``dataset`` (a stream) as this rank reads it: its slice, dealt over the loader's workers,
    shuffled with a seeded buffer of ``shuffle_buffer`` items, epoch after epoch; ``iter()``
    gives a :class:`SlotStream`, whose state is the position (see the module docstring)."""

    def __init__(
        self,
        dataset: Any,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
    ) -> None:
        self.dataset = dataset
        self.source = stream_source(dataset)
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self.start_epoch = 0
        self.carry: dict[int, dict[str, Any]] = {}  # slot -> what ``deal_positions`` dealt it

    def by_shards(self, slots: int) -> bool:
        """Whether ``slots`` readers split the stream by shards (else by items): where the
        shards divide evenly (as ``split_dataset_by_node``), or are many enough (8 a reader or
        more) that one shard more or less is a small difference."""
        shards = self.source.num_shards
        return shards >= slots and (shards % slots == 0 or shards >= 8 * slots)

    def __iter__(self) -> Any:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        slot, slots = self.rank * workers + worker, self.world_size * workers
        if callable(getattr(self.dataset, "slot_stream", None)):  # a MixedStream
            return self.dataset.slot_stream(self, slot, slots)
        reader = SlotStream(self, slot, slots)
        if slot in self.carry:
            reader.carry(self.carry[slot])
        self.reader = reader  # what this process reads (a worker's: ``SeededCollate``)
        return reader

    def __repr__(self) -> str:
        return (
            f"ShardedStream({self.dataset!r}, rank={self.rank}/{self.world_size}, "
            f"shards={self.source.num_shards}, shuffle_buffer={self.shuffle_buffer})"
        )


def read_stream(dataset: Any, limit: int | None = None) -> list[Any]:
    """One pass over the stream ``dataset`` in its order (its first ``limit`` items): an
    evaluation stream, read once into a list that evaluation then shares over ranks in order."""
    stream = ShardedStream(dataset, shuffle=False)
    if callable(getattr(dataset, "slot_stream", None)):  # a MixedStream: endless, no epoch
        if limit is None:
            raise ValueError(
                "an evaluation mixture of streams never ends; set max_eval_batches to bound it"
            )
        return list(itertools.islice(iter(stream), limit))
    slot = SlotStream(stream, 0, 1)
    items: list[Any] = []
    for item in slot:
        if slot.epoch > 0 or (limit is not None and len(items) >= limit):
            break
        items.append(item)
    return items


# --------------------------------------------------------------------------- the loader
class StreamLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` over a :class:`ShardedStream`: one endless pass over the epochs
    of the stream (``iter()`` once; ``max_steps`` ends training). ``state_dict()`` holds every
    slot's position; ``position()`` summarises it (epoch, shards read, items)."""

    is_stream = True

    def set_epoch(self, epoch: int) -> None:  # the slots count their own epochs
        pass

    def live_epoch(self) -> int | None:
        """The epoch of the last item read, where the stream is read in this process (no
        workers); None otherwise (a worker's epoch is known from its saved state)."""
        fetcher = getattr(self._iterator, "_dataset_fetcher", None)
        slot = getattr(fetcher, "dataset_iter", None)
        return slot.epoch if isinstance(slot, SlotStream) else None

    def position(self, state: dict[str, Any] | None = None) -> dict[str, int]:
        """This rank's place in the stream: the lowest epoch among its slots, the shards they
        finished in it and the items they gave out in it."""
        slots = slot_states(self.state_dict() if state is None else state)
        if not slots:
            return {"epoch": 0, "shards": 0, "items": 0}
        epoch = min(s["epoch"] for s in slots)
        now = [s for s in slots if s["epoch"] == epoch]
        shards = [s["shard"] for s in now]  # each slot's finished shards of the epoch
        return {
            "epoch": epoch,
            # by shards the slots read different shards; by items they all read every shard
            "shards": sum(shards) if now[0].get("split") == "shards" else min(shards),
            "items": sum(s["yielded"] for s in now),
        }

    def continue_from(self, ranks: list[dict[str, Any]], batch_size: int) -> dict[str, int]:
        """Continue the stream from the loader states ``ranks`` (one per saved rank) saved by
        another count of readers (ranks x loader workers): the saved epochs' shards not read
        yet, and the shuffle buffers' items, are dealt to this job's readers
        (``deal_positions``); this rank's go to its slots. ``batch_size``: the saved one.
        Raises ValueError where that cannot be exact."""
        stream = self.dataset
        saved = [
            slot
            for rank, state in enumerate(ranks)
            for slot in current_slots(stream, state, rank, len(ranks), batch_size)
        ]
        workers = max(self.num_workers, 1)
        dealt = deal_positions(stream, saved, stream.world_size * workers)
        first = stream.rank * workers
        stream.carry = {slot: dealt[slot] for slot in range(first, first + workers)}
        return {
            "epoch": dealt[0]["epoch"],
            "slots": saved[0]["slots"],
            "shards": sum(len(d["pending"]) for d in dealt),
            "buffered": sum(len(d["buffer"]) for d in dealt),
        }


def current_slots(
    stream: ShardedStream, state: dict[str, Any], rank: int, world: int, batch_size: int
) -> list[dict[str, Any]]:
    """The slot states of one saved rank's loader ``state`` as of the last batch the rank
    took: a loader worker's state is its last snapshot, so it is read on (here, in this
    process) by the batches it gave since (``StatefulDataLoader`` deals batches to its
    workers in turn, after the one that gave the snapshot's last)."""
    found = slot_states(state)
    if not found:
        return []
    slots = int(found[0]["slots"])
    workers = max(slots // world, 1)
    since = int(state.get("_steps_since_snapshot", 0) or 0)
    last = int((state.get("_snapshot") or {}).get("_last_yielded_worker_id", workers - 1))
    given = [0] * workers
    for step in range(since):
        given[(last + 1 + step) % workers] += 1
    current = []
    for saved in found:
        count = given[int(saved["slot"]) - rank * workers] * batch_size
        if count:
            reader = SlotStream(stream, int(saved["slot"]), slots)
            reader.load_state_dict(saved)
            for _ in range(count):
                next(reader)
            saved = reader.state_dict()
        current.append(saved)
    return current


def deal_positions(
    stream: ShardedStream, saved: list[dict[str, Any]], slots: int
) -> list[dict[str, Any]]:
    """What each of ``slots`` new readers takes over from the ``saved`` readers' states
    (every saved slot's, as of the same step): in the latest saved epoch, the shards no saved
    reader finished (from the saved offset of one it was reading) and the items in the saved
    shuffle buffers, dealt in turn; the epochs after it are split as the new readers split
    them. Every item of those epochs reaches one new reader once. Raises ValueError where the
    saved readers kept 1 item in N of each shard (a split by items) or carried state between
    shards (a packed stream's tokens): those cannot be dealt exactly."""
    if not saved:
        raise ValueError("the checkpoint holds no reader's position")
    count = int(saved[0]["slots"])
    if sorted(int(s["slot"]) for s in saved) != list(range(count)):
        raise ValueError(f"the checkpoint holds {len(saved)} of its {count} readers' positions")
    if any(s.get("split") != "shards" for s in saved):
        raise ValueError(
            f"its {count} readers split the stream by items (each kept 1 item in {count}; "
            f"{stream.source.num_shards} shard(s) do not deal evenly to them), which another "
            "count of readers cannot continue"
        )
    if any(s.get("source") is not None for s in saved):
        raise ValueError(
            "its readers carry state from shard to shard (a packed stream's tokens), which "
            "another count of readers cannot continue"
        )
    saved = sorted(saved, key=lambda s: int(s["slot"]))
    last = max(int(s["epoch"]) for s in saved)
    pieces = [dict(piece) for s in saved for piece in s.get("pending") or []]
    for epoch in range(min(int(s["epoch"]) for s in saved), last + 1):
        order = shard_order(stream.source.num_shards, stream.seed, epoch, stream.shuffle)
        for s in saved:
            own, at = order[int(s["slot"]) :: count], int(s["epoch"])
            if at > epoch:
                continue  # this reader finished its shards of the epoch
            start = int(s["shard"]) if at == epoch else 0
            for index, shard in enumerate(own[start:]):
                where = s["position"] if at == epoch and index == 0 else None
                pieces.append({"epoch": epoch, "shard": shard, "position": where})
    buffered = [item for s in saved for item in s["buffer"]]
    return [
        {"epoch": last, "pending": pieces[slot::slots], "buffer": buffered[slot::slots]}
        for slot in range(slots)
    ]


def slot_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The :class:`SlotStream` states inside a ``StatefulDataLoader`` state."""
    found: list[dict[str, Any]] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "slots" in value and "buffer" in value and "epoch" in value:
                found.append(value)
                return
            for inner in value.values():
                walk(inner)
        elif isinstance(value, list):  # a mixture's sources
            for inner in value:
                walk(inner)

    walk(state)
    return found


class SeededCollate:
    """``collate_fn`` as a loader worker runs it: Python's, numpy's and torch's generators are
    first seeded from (seed, the reader's slot, its epoch, the items it has given out), which
    name the batch, so what a collator draws is the same in a resumed run (a worker's
    generators are otherwise seeded once per worker, and a resume replays no draws)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None, seed: int) -> None:
        from torch.utils.data import default_collate

        self.collate_fn, self.seed = collate_fn or default_collate, seed

    def __call__(self, items: list[Any]) -> Any:
        info = get_worker_info()
        reader = getattr(getattr(info, "dataset", None), "reader", None)
        if isinstance(reader, SlotStream):
            from forge.data.loader import seed_generators

            text = (
                f"{self.seed}:{reader.slot}:{reader.epoch}:{reader.yielded}:{len(reader.pending)}"
            )
            seed_generators(
                int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
            )
        return self.collate_fn(items)


def build_stream_loader(
    dataset: Any,
    *,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    shuffle_buffer: int = 1000,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    snapshot_every: int = 32,
) -> StreamLoader:
    """A resumable loader of this rank's slice of the stream ``dataset`` (see the module
    docstring), in batches of ``batch_size`` items."""
    stream = ShardedStream(
        dataset,
        rank=rank,
        world_size=world_size,
        seed=seed,
        shuffle=shuffle,
        shuffle_buffer=shuffle_buffer,
    )
    workers: dict[str, Any] = {}
    if num_workers:
        workers = {
            "persistent_workers": persistent_workers,
            "prefetch_factor": prefetch_factor,
            "multiprocessing_context": multiprocessing_context,
            "worker_init_fn": worker_init_fn,
        }
        collate_fn = SeededCollate(collate_fn, seed)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StreamLoader(
            stream,
            batch_size=batch_size,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            # a worker sends its position (shuffle buffer included) every ``snapshot_every``
            # batches; a state taken between two is that snapshot plus the batches since,
            # which a resume fetches again (at most ``snapshot_every - 1``, at any step)
            snapshot_every_n_steps=snapshot_every if num_workers else 1,
            # iter() draws its workers' base seed from this, not from torch's generator, which
            # a resumed run would then leave elsewhere than the straight run (one iter() each)
            generator=torch.Generator().manual_seed(seed),
            **workers,
        )
