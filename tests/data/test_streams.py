"""Streams (forge/data/streams.py): every item of an epoch to exactly one (rank, worker) slot,
seeded shuffling, and an exact resume from the saved position."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

from forge.data.stream_parts import MixedStream, PackedStream
from forge.data.streams import (
    ShardedStream,
    ShardReader,
    SlotStream,
    StreamError,
    build_stream_loader,
    slot_states,
)

RANKS, WORKERS = 2, 2


class Numbers(IterableDataset):
    """0 .. n-1 as ``{"x": i}``: a stream that knows nothing of ranks, shards or state."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": i}


class CountingNumbers(Numbers):
    """``Numbers`` with a ``state_dict()`` of its own (how many items it gave)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.start = self.given = 0

    def __iter__(self):
        self.given = self.start
        for i in range(self.start, self.n):
            self.given = i + 1
            yield {"x": i}
        self.start = 0

    def state_dict(self):
        return {"given": self.given}

    def load_state_dict(self, state):
        self.start = state["given"]


def read_shard(shard: int):
    for i in range(6):
        yield {"x": shard * 100 + i}


def jsonl_stream(directory: Path, shards: int, rows: int):
    """A ``datasets`` stream over ``shards`` jsonl files of ``rows`` rows each."""
    import datasets

    files = []
    for shard in range(shards):
        path = directory / f"part-{shard}.jsonl"
        path.write_text("".join(json.dumps({"x": shard * 100 + i}) + "\n" for i in range(rows)))
        files.append(str(path))
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True)


def all_items(dataset) -> list[int]:
    if isinstance(dataset, ShardReader):
        return [item["x"] for shard in dataset.shards for item in dataset.read(shard)]
    return [item["x"] for item in dataset]


def epochs_by_slot(dataset, epochs: int = 2, **settings) -> dict[int, list[list[int]]]:
    """What every (rank, worker) slot reads in each of the first ``epochs`` epochs."""
    slots = RANKS * WORKERS
    read: dict[int, list[list[int]]] = {e: [] for e in range(epochs)}
    for rank in range(RANKS):
        stream = ShardedStream(dataset, rank=rank, world_size=RANKS, seed=5, **settings)
        for worker in range(WORKERS):
            slot = SlotStream(stream, rank * WORKERS + worker, slots)
            mine: dict[int, list[int]] = {e: [] for e in range(epochs)}
            for item in slot:
                if slot.epoch >= epochs:
                    break
                mine[slot.epoch].append(item["x"])
            for epoch in range(epochs):
                read[epoch].append(mine[epoch])
    return read


@pytest.fixture(
    params=["torch", "stateful torch", "reader 4", "reader 3", "jsonl 4", "jsonl 3"],
)
def stream(request, tmp_path):
    kind, _, shards = request.param.partition(" ")
    if kind == "torch":
        return Numbers(23)
    if kind == "stateful":
        return CountingNumbers(23)
    if kind == "reader":
        return ShardReader(list(range(int(shards))), read_shard)
    return jsonl_stream(tmp_path, int(shards), 7)


def test_every_item_of_an_epoch_reaches_exactly_one_slot(stream):
    """2 ranks x 2 workers, shard counts that divide (4) and that do not (3, 1): each epoch's
    items, over all slots, are the stream's items once each; the shuffled order differs from
    one epoch to the next and is the same for the same seed."""
    expected = sorted(all_items(stream))
    read = epochs_by_slot(stream, shuffle_buffer=4)
    for epoch, slots in read.items():
        assert sorted(x for slot in slots for x in slot) == expected, f"epoch {epoch}"
        assert all(slots), f"a slot read nothing in epoch {epoch}"
    assert read[0] != read[1]
    assert epochs_by_slot(stream, shuffle_buffer=4) == read


def test_shuffling_off_reads_in_order():
    read = epochs_by_slot(Numbers(12), shuffle=False)
    assert read[0] == read[1] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]


def take(loader, count: int) -> list[list[int]]:
    batches = iter(loader)
    return [next(batches)["x"].tolist() for _ in range(count)]


def saved(loader) -> dict:
    """The loader's state as a checkpoint holds it (torch.save, read back weights_only)."""
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class Offset(Numbers):
    """``Numbers`` shifted by 1000: tells a mixture's second source from its first."""

    def __iter__(self):
        for item in super().__iter__():
            yield {"x": item["x"] + 1000}


def texts_reader() -> ShardReader:
    return ShardReader([f"doc {n}: " + "word " * (n * 7 % 23) for n in range(9)], text_item)


def text_item(text: str):
    yield {"text": text}


KINDS = ["torch", "stateful torch", "jsonl 3", "packed", "mixed"]


@pytest.mark.parametrize(
    ("kind", "workers"),
    [(kind, 0) for kind in KINDS]
    + [(kind, 2) if kind == "jsonl 3" else pytest.param(kind, 2, marks=pytest.mark.slow)
       for kind in KINDS],
)  # fmt: skip
def test_a_resumed_loader_continues_exactly(tmp_path, kind, workers, small_tokenizer):
    """Straight 14 batches == 6 batches, the state saved and loaded into a new loader, then 8
    more: across epoch ends, with a shuffle buffer, on rank 1 of 2, with and without workers;
    for a packed stream (its carried tokens) and a mixture (its sources and draws) too."""
    if kind == "torch":
        dataset = Numbers(23)
    elif kind == "stateful torch":
        dataset = CountingNumbers(23)
    elif kind == "packed":
        dataset = PackedStream(texts_reader(), small_tokenizer, block_size=4, text_column="text")
    elif kind == "mixed":
        dataset = MixedStream([Numbers(11), jsonl_stream(tmp_path, 3, 5)], [0.7, 0.3])
    else:
        dataset = jsonl_stream(tmp_path, 3, 9)
    if kind == "packed":

        def take(loader, count):  # blocks, not numbers
            batches = iter(loader)
            return [next(batches)["input_ids"].tolist() for _ in range(count)]
    else:
        take = globals()["take"]

    def loader():
        return build_stream_loader(
            dataset, batch_size=3, rank=1, world_size=2, num_workers=workers, shuffle_buffer=5,
            seed=3,
        )  # fmt: skip

    straight = take(loader(), 14)
    first = loader()
    head = take(first, 6)
    state = saved(first)
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + take(resumed, 8) == straight
    assert {s["slots"] for s in slot_states(state)} == {2 * max(workers, 1)}


def test_a_packed_stream_resumed_in_the_blocks_of_a_read_document_continues_exactly(
    small_tokenizer,
):
    """One long document a shard: after most checkpoints every document of the shard is read
    and the saved carry still holds several of its blocks. Resumed there, the blocks come
    from that shard, as in the straight run, not after the epoch's buffered last items."""
    reader = ShardReader([f"doc {n}: " + "word " * 40 for n in range(3)], text_item)
    dataset = PackedStream(reader, small_tokenizer, block_size=4, text_column="text")

    def loader():
        return build_stream_loader(dataset, batch_size=2, shuffle_buffer=3, seed=1)

    def blocks(batches, count):
        return [next(batches)["input_ids"].tolist() for _ in range(count)]

    straight = blocks(iter(loader()), 40)  # 3 documents of over 20 blocks each: 2 epochs
    for stop in range(1, 40, 3):
        first = loader()
        head = blocks(iter(first), stop)
        state = saved(first)
        resumed = loader()
        resumed.load_state_dict(state)
        assert head + blocks(iter(resumed), 40 - stop) == straight, stop


def test_the_shuffle_buffer_is_part_of_the_state():
    loader = build_stream_loader(Numbers(50), batch_size=2, shuffle_buffer=8, seed=1)
    take(loader, 3)
    (slot,) = slot_states(loader.state_dict())
    assert len(slot["buffer"]) == 8 and slot["yielded"] == 6


def test_every_item_once_through_real_loaders_over_ranks_and_workers(tmp_path):
    """2 ranks x 2 loader workers (worker processes) read one epoch of a 3-shard jsonl stream
    (24 rows: 6 per slot, 2 batches of 3 per worker): every row once."""
    dataset = jsonl_stream(tmp_path, 3, 8)
    counted: Counter[int] = Counter()
    for rank in range(RANKS):
        loader = build_stream_loader(
            dataset, batch_size=3, rank=rank, world_size=RANKS, num_workers=WORKERS, seed=0
        )
        for batch in take(loader, 4):
            counted.update(batch)
    assert counted == Counter(all_items(dataset))


def test_a_corrupt_shard_is_named(tmp_path):
    dataset = jsonl_stream(tmp_path, 2, 4)
    with open(tmp_path / "part-1.jsonl", "a") as file:
        file.write('{"x": 7\n')
    loader = build_stream_loader(dataset, batch_size=2, shuffle=False)
    with pytest.raises(StreamError, match="part-1.jsonl"):
        take(loader, 10)


def test_a_datasets_shuffle_is_refused(tmp_path):
    dataset = jsonl_stream(tmp_path, 2, 4).shuffle(seed=0, buffer_size=4)
    with pytest.raises(ValueError, match="stream_shuffle_buffer"):
        build_stream_loader(dataset, batch_size=2)


def test_a_stream_that_yields_nothing_ends_instead_of_spinning():
    loader = build_stream_loader(Numbers(0), batch_size=2)
    assert list(loader) == []


def test_a_packed_stream_cuts_the_token_stream_into_blocks(small_tokenizer):
    """In order, the blocks are the documents' tokens (each followed by eos) cut every
    block_size tokens, the remainder carried over shard ends into the next block."""
    from forge.data.datasets import tokenize_and_pack

    reader = texts_reader()
    packed = PackedStream(reader, small_tokenizer, block_size=5, text_column="text")
    slot = SlotStream(ShardedStream(packed, shuffle=False), 0, 1)
    blocks = []
    for block in slot:
        if slot.epoch > 0:
            break
        blocks.append(block["input_ids"])
    eos = small_tokenizer.eos_token_id
    expected = torch.from_numpy(tokenize_and_pack(small_tokenizer, reader.shards, eos)).long()
    assert torch.equal(torch.cat(blocks), expected[: len(blocks) * 5])
    assert len(expected) - len(blocks) * 5 < 5


def test_a_mixture_draws_its_sources_by_their_weights():
    mixed = MixedStream([Numbers(40), Offset(40)], [0.75, 0.25])
    loader = build_stream_loader(mixed, batch_size=10, seed=2)
    drawn = [x for batch in take(loader, 40) for x in batch]
    first = sum(x < 1000 for x in drawn) / len(drawn)
    assert 0.7 < first < 0.8
    assert take(build_stream_loader(mixed, batch_size=10, seed=2), 40) == [
        drawn[i : i + 10] for i in range(0, 400, 10)
    ]


def test_an_evaluation_stream_is_one_pass_and_an_endless_mixture_needs_a_bound():
    from forge.data.streams import read_stream

    assert [item["x"] for item in read_stream(Numbers(5))] == [0, 1, 2, 3, 4]
    assert [item["x"] for item in read_stream(Numbers(5), 2)] == [0, 1]
    mixed = MixedStream([Numbers(3), Offset(3)])
    assert len(read_stream(mixed, 7)) == 7
    with pytest.raises(ValueError, match="max_eval_batches"):
        read_stream(mixed)


def _saved_ranks(dataset, world: int, workers: int, batches: list[int]) -> tuple[list, Counter]:
    """``world`` ranks of ``workers`` loader workers each read ``batches[rank]`` batches of 3;
    their positions as a checkpoint holds them, and the items they read."""
    from forge.train.stream_position import StreamPosition

    states, read = [], Counter()
    for rank in range(world):
        loader = build_stream_loader(
            dataset, batch_size=3, rank=rank, world_size=world, num_workers=workers, seed=4,
            shuffle_buffer=4, snapshot_every=2,
        )  # fmt: skip
        for batch in take(loader, batches[rank]):
            read.update(batch)
        states.append(saved_position(StreamPosition(loader)))
    return states, read


def saved_position(position) -> dict:
    buffer = io.BytesIO()
    torch.save(position.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("kind", "before", "after"),
    [("reader", (2, 0), (3, 0)), ("reader", (1, 0), (2, 2)), ("jsonl", (2, 0), (1, 0))]
    + [pytest.param("reader", (2, 2), (1, 3), marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_stream_continues_on_another_count_of_readers(tmp_path, kind, before, after):
    """Saved by 2 ranks (x workers), continued by 1 or 3 (x workers): the shards no reader
    finished and the buffered items are dealt to the new readers; every item of the epochs
    read so far reaches one reader once, whichever saved rank or new reader reads it."""
    from forge.train.stream_position import StreamPosition

    dataset = (
        ShardReader(list(range(8)), read_shard)
        if kind == "reader"
        else jsonl_stream(tmp_path, 8, 5)
    )
    (world, workers), (new_world, new_workers) = before, after
    states, counted = _saved_ranks(dataset, world, workers, [3, 2])
    epoch = None
    for rank in range(new_world):
        loader = build_stream_loader(
            dataset, batch_size=3, rank=rank, world_size=new_world, num_workers=new_workers,
            seed=4, shuffle_buffer=4,
        )  # fmt: skip
        position = StreamPosition(loader, fix="set ignore_data_skip")
        position.reshape("saved by another size", states)
        assert position.restored
        stream, readers = loader.dataset, max(new_workers, 1)
        for worker in range(readers):
            slot = rank * readers + worker
            reader = SlotStream(stream, slot, new_world * readers)
            reader.carry(stream.carry[slot])
            epoch = reader.epoch
            for item in reader:
                if reader.epoch > epoch:
                    break
                counted[item["x"]] += 1
    assert epoch is not None
    assert counted == Counter({x: epoch + 1 for x in all_items(dataset)})


def test_a_stream_split_by_items_is_not_dealt_to_another_count_of_readers():
    """3 shards over 2 readers are split by items (1 in 2): another count is refused, naming
    how to go on."""
    from forge.checkpoint import CheckpointError
    from forge.train.stream_position import StreamPosition

    dataset = ShardReader(list(range(3)), read_shard)
    states, _ = _saved_ranks(dataset, 2, 0, [2, 2])
    loader = build_stream_loader(dataset, batch_size=3, seed=4, shuffle_buffer=4)
    with pytest.raises(CheckpointError, match="split the stream by items.*ignore_data_skip"):
        StreamPosition(loader, fix="set ignore_data_skip").reshape("saved by 2", states)


def test_a_collator_drawing_in_loader_workers_resumes_exactly(tmp_path):
    """A collator that adds noise, in 2 loader workers: 3 batches, saved, loaded into a new
    loader, 4 more == 7 straight (its draws are seeded per batch, not per worker)."""

    def noisy(items):
        return {"x": torch.tensor([i["x"] for i in items]) + torch.rand(len(items))}

    def loader():
        return build_stream_loader(
            jsonl_stream(tmp_path, 4, 6), batch_size=3, collate_fn=noisy, num_workers=2,
            shuffle_buffer=4, seed=2, snapshot_every=2,
        )  # fmt: skip

    straight = take(loader(), 7)
    first = loader()
    head = take(first, 3)
    resumed = loader()
    resumed.load_state_dict(saved(first))
    assert head + take(resumed, 4) == straight


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor(3), torch.tensor(2.5), torch.tensor(True), torch.arange(6).reshape(2, 3)],
    ids=["int-scalar", "float-scalar", "bool-scalar", "matrix"],
)
def test_a_buffered_item_is_kept_in_the_state_as_it_was(tensor):
    """A shuffle buffer's items travel in the state as plain values: a scalar label (a 0-d
    tensor) too, which once failed the save of every 2-rank stream run with such labels."""
    from forge.data.streams import _plain, _restored

    back = _restored(_plain({"label": tensor, "x": [tensor]}))
    assert back["label"].dtype == tensor.dtype and back["label"].shape == tensor.shape
    assert torch.equal(back["label"], tensor) and torch.equal(back["x"][0], tensor)


def test_telling_a_stream_from_a_dataset_does_not_import_datasets(tmp_path):
    """A run on a map-style dataset is asked whether its data is a stream; answering must not
    cost the import of Hugging Face ``datasets`` (half a second at every start) where nothing
    uses it, and a ``datasets`` stream is still one once ``datasets`` is loaded."""
    from tests.helpers import run_python

    script = """
import sys
from forge.data.stream_sources import is_stream
assert not is_stream([1, 2, 3])
assert "datasets" not in sys.modules, "is_stream imported datasets"
import datasets
stream = datasets.Dataset.from_dict({"x": [1, 2]}).to_iterable_dataset()
assert is_stream(stream)
assert not is_stream(datasets.Dataset.from_dict({"x": [1, 2]}))
"""
    result = run_python(script)
    assert result.returncode == 0, result.stderr
