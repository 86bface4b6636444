"""Where a stream's items come from (forge/data/streams.py reads them): a ``StreamSource`` opens
one shard at a saved position and says where it is. ``HFStreamSource`` reads a
``datasets.IterableDataset`` shard by shard, ``TorchStreamSource`` a torch ``IterableDataset``
(one shard), ``ReaderSource`` one's own :class:`ShardReader`; what is built on streams
(forge/data/stream_parts.py) brings its own, through ``stream_source()``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

__all__ = [
    "HFStreamSource",
    "ReaderSource",
    "ShardCursor",
    "ShardReader",
    "StreamSource",
    "TorchStreamSource",
    "is_stream",
    "stream_source",
]


def is_stream(dataset: Any) -> bool:
    """True for a dataset forge reads as a stream: torch's ``IterableDataset``,
    ``datasets.IterableDataset``, a ``ShardReader``, or what is built on streams
    (forge/data/stream_parts.py: anything with a ``stream_source()``)."""
    if isinstance(dataset, (IterableDataset, ShardReader)):
        return True
    if callable(getattr(dataset, "stream_source", None)):
        return True
    return _is_hf_stream(dataset)


class StreamSource:
    """How a stream is read: ``num_shards`` shards, each opened at a saved position."""

    num_shards: int = 1
    stateful: bool = True  # False: a position is reached by re-reading the shard

    def shard_name(self, shard: int) -> str:
        return f"shard {shard}"

    def open(self, shard: int, epoch: int, position: Any) -> ShardCursor:
        raise NotImplementedError

    def state(self) -> Any:
        """What the source itself carries from shard to shard (a packer's tokens), if any."""
        return None

    def restore(self, state: Any) -> None:
        pass


class ShardCursor:
    """One shard being read: an iterator of items whose ``position()`` says where it is (what
    ``open`` takes back to continue after the last item read)."""

    def __init__(self, items: Iterator[Any], position: Callable[[], Any]) -> None:
        self.items, self.position = items, position

    def __iter__(self) -> Iterator[Any]:
        return self.items


class ShardReader:
    """One's own reader of shards: ``read(shard)`` yields the items of one shard (a file name,
    a URL, any picklable value); ``shards`` lists them. forge deals the shards to ranks and
    workers, reshuffles their order each epoch and resumes inside a shard by skipping the items
    already read in it (the cost of one shard at most). ``read`` may instead take
    ``(shard, start)`` and begin at item ``start`` itself (``seekable=True``)."""

    def __init__(
        self,
        shards: Sequence[Any],
        read: Callable[..., Iterable[Any]],
        *,
        seekable: bool = False,
    ) -> None:
        if not shards:
            raise ValueError("ShardReader needs at least one shard (got none)")
        self.shards, self.read, self.seekable = list(shards), read, seekable

    def __repr__(self) -> str:
        return f"ShardReader({len(self.shards)} shards, read={getattr(self.read, '__name__', self.read)})"


class ReaderSource(StreamSource):
    """A :class:`ShardReader`: the position inside a shard is the count of items read."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader
        self.num_shards = len(reader.shards)
        self.stateful = reader.seekable

    def shard_name(self, shard: int) -> str:
        return str(self.reader.shards[shard])

    def open(self, shard: int, epoch: int, position: Any) -> ShardCursor:
        start = int(position or 0)
        name = self.reader.shards[shard]
        if self.reader.seekable:
            items = iter(self.reader.read(name, start))
        else:
            items = iter(self.reader.read(name))
            for _ in range(start):
                next(items)
        count = [start]

        def counted() -> Iterator[Any]:
            for item in items:
                count[0] += 1
                yield item

        return ShardCursor(counted(), lambda: count[0])


class TorchStreamSource(StreamSource):
    """A torch ``IterableDataset`` as one shard; ``set_epoch(epoch)`` is called before each
    pass where it exists. Its position is its own ``state_dict()`` where it defines one (with
    ``load_state_dict``), else the count of items read (re-read on resume)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )

    def shard_name(self, shard: int) -> str:
        return type(self.dataset).__name__

    def open(self, shard: int, epoch: int, position: Any) -> ShardCursor:
        dataset = self.dataset
        if callable(getattr(dataset, "set_epoch", None)):
            dataset.set_epoch(epoch)
        if self.stateful:
            if position is not None:
                dataset.load_state_dict(position)
            return ShardCursor(iter(dataset), dataset.state_dict)
        return ReaderSource(ShardReader([dataset], iter)).open(0, epoch, position)


class HFStreamSource(StreamSource):
    """A ``datasets.IterableDataset``: its own shards (files, or parts of them), each read on its
    own and positioned by ``datasets``' ``state_dict()`` (rows of a parquet or arrow file are
    sought, lines of a json or text file re-read)."""

    def __init__(self, dataset: Any) -> None:
        if _buffer_shuffled(getattr(dataset, "_ex_iterable", None)):
            raise ValueError(
                "the datasets.IterableDataset was shuffled with .shuffle(); its shuffle buffer is "
                "not restored on resume (datasets drops it), so forge shuffles the stream itself: "
                "remove .shuffle() and set the trainer's stream_shuffle_buffer instead"
            )
        self.dataset = dataset
        self.num_shards = max(int(dataset.num_shards), 1)
        self._files = _data_files(dataset)

    def shard_name(self, shard: int) -> str:
        if self._files and len(self._files) == self.num_shards:
            return str(self._files[shard])
        return f"shard {shard} of {self.num_shards}"

    def open(self, shard: int, epoch: int, position: Any) -> ShardCursor:
        part = self.dataset
        if self.num_shards > 1:
            part = part.shard(num_shards=self.num_shards, index=shard, contiguous=True)
        if position is not None:
            part.load_state_dict(position)
        # .iter() reads this shard in this process: iterating the dataset itself inside a
        # loader worker would split it once more by worker
        rows = ({key: values[0] for key, values in row.items()} for row in part.iter(1))
        return ShardCursor(rows, part.state_dict)


def _buffer_shuffled(node: Any) -> bool:
    """Whether a ``datasets`` stream's pipeline holds a shuffle buffer (``.shuffle()``)."""
    if node is None:
        return False
    if type(node).__name__ == "BufferShuffledExamplesIterable":
        return True
    inner = [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]
    return any(_buffer_shuffled(child) for child in inner if child is not None)


def _data_files(dataset: Any) -> list[Any]:
    """The files a ``datasets`` stream reads, in shard order, where it says (else [])."""
    kwargs = getattr(getattr(dataset, "_ex_iterable", None), "kwargs", None) or {}
    files = kwargs.get("base_files", kwargs.get("files"))
    return list(files) if isinstance(files, list) else []


def stream_source(dataset: Any) -> StreamSource:
    """The :class:`StreamSource` that reads ``dataset``."""
    if callable(getattr(dataset, "stream_source", None)):  # PackedStream, MixedStream
        return dataset.stream_source()
    if isinstance(dataset, ShardReader):
        return ReaderSource(dataset)
    if isinstance(dataset, IterableDataset) and not _is_hf_stream(dataset):
        return TorchStreamSource(dataset)
    if _is_hf_stream(dataset):
        return HFStreamSource(dataset)
    raise TypeError(f"{type(dataset).__name__} is no stream forge can read")


def _is_hf_stream(dataset: Any) -> bool:
    """A ``datasets.IterableDataset``. Only a process that imported ``datasets`` can hold one:
    asking does not import it (half a second at every start of a run that does not use it)."""
    datasets = sys.modules.get("datasets")
    iterable = getattr(datasets, "IterableDataset", None)
    return iterable is not None and isinstance(dataset, iterable)
