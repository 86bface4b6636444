from __future__ import annotations

import io
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch.utils.data import Dataset

from forge.data import (
    CausalLMCollator,
    PackedTextDataset,
    ResumableDataLoader,
    build_dataloader,
    loader_epoch_length,
)

SIZE, BATCH = 22, 4


class Indices(Dataset):
    """Item i is tensor([i]): batches show exactly which samples were drawn."""

    def __init__(self, size: int = SIZE) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


Batches = list[torch.Tensor]


def _factory(**kwargs) -> Callable[[], ResumableDataLoader]:
    kwargs = {"batch_size": BATCH, "seed": 3, **kwargs}
    dataset = kwargs.pop("dataset", None) or Indices()
    return lambda: build_dataloader(dataset, **kwargs)


def _epoch(loader: ResumableDataLoader, epoch: int) -> Batches:
    loader.set_epoch(epoch)
    return list(loader)


def _same(left: Batches, right: Batches) -> bool:
    return len(left) == len(right) and all(_equal(a, b) for a, b in zip(left, right, strict=True))


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def _roundtrip(state: dict) -> dict:
    """What a checkpoint does to the state: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _check_resume(make: Callable[[], ResumableDataLoader], epoch: int, ks: list[int]) -> None:
    """Stop after k batches of `epoch`, resume a fresh loader: the batches must not change.

    The state is taken after `epoch` full epochs before it, and the resumed loader must also
    run the following epoch exactly.
    """
    reference = make()
    expected = {e: _epoch(reference, e) for e in range(epoch + 2)}
    for k in ks:
        loader = make()
        for e in range(epoch):
            _epoch(loader, e)
        loader.set_epoch(epoch)
        iterator = iter(loader)
        seen = [next(iterator) for _ in range(k)]
        state = _roundtrip(loader.state_dict())
        del iterator, loader

        resumed = make()
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert _same(seen + rest, expected[epoch]), f"epoch {epoch}: resumed after {k} batches"
        assert _same(_epoch(resumed, epoch + 1), expected[epoch + 1]), f"epoch after k={k}"


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("epoch", [0, 1])
def test_exact_resume_at_every_step_single_process(epoch: int, drop_last: bool) -> None:
    make = _factory(drop_last=drop_last)
    # k == length: the state is taken right after the epoch's last batch
    _check_resume(make, epoch, list(range(loader_epoch_length(make()) + 1)))


@pytest.mark.parametrize("drop_last", [True, False])
def test_exact_resume_with_workers(drop_last: bool) -> None:
    make = _factory(drop_last=drop_last, num_workers=2)
    length = len(make())
    _check_resume(make, 0, [2])
    _check_resume(make, 1, [0, 1, length - 1, length])


def test_exact_resume_with_persistent_workers() -> None:
    _check_resume(_factory(num_workers=2, persistent_workers=True), 1, [0, 3, 5])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("rank", [0, 1])
def test_exact_resume_per_rank(rank: int, num_workers: int) -> None:
    make = _factory(rank=rank, world_size=2, drop_last=False, num_workers=num_workers)
    length = len(make())
    _check_resume(make, 1, [1, length] if num_workers else list(range(length + 1)))


def test_any_rank_can_load_rank_zero_state() -> None:
    rank0, rank1 = _factory(rank=0, world_size=2), _factory(rank=1, world_size=2)
    expected = _epoch(rank1(), 2)
    loader = rank0()
    loader.set_epoch(2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = rank1()
    resumed.load_state_dict(state)
    assert _same(list(resumed), expected[1:])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("set_next_epoch_first", [False, True])
def test_state_after_the_epoch_ended(num_workers: int, set_next_epoch_first: bool) -> None:
    """A state taken after StopIteration resumes into a full next epoch."""
    make = _factory(num_workers=num_workers)
    expected = _epoch(make(), 1)
    loader = make()
    _epoch(loader, 0)
    if set_next_epoch_first:  # a trainer may move on to the next epoch before it saves
        loader.set_epoch(1)
    resumed = make()
    resumed.load_state_dict(_roundtrip(loader.state_dict()))
    assert _same(_epoch(resumed, 1), expected)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_before_iter_then_set_epoch(num_workers: int) -> None:
    make = _factory(num_workers=num_workers)
    expected = _epoch(make(), 2)
    loader = make()
    initial = loader.state_dict()  # builds an iterator for epoch 0 before any iter()
    assert _same(_epoch(loader, 2), expected)
    resumed = make()
    resumed.load_state_dict(initial)
    assert _same(_epoch(resumed, 0), _epoch(make(), 0))


def test_state_names_the_epoch_and_restores_it_without_set_epoch() -> None:
    make = _factory()
    expected = _epoch(make(), 4)
    loader = make()
    loader.set_epoch(4)
    iterator = iter(loader)
    seen = [next(iterator) for _ in range(2)]
    state = loader.state_dict()
    assert state["_sampler_iter_state"]["sampler_state"]["epoch"] == 4
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.epoch == 4
    assert _same(seen + list(resumed), expected)


def test_set_epoch_to_another_epoch_discards_the_saved_position() -> None:
    make = _factory()
    loader = make()
    loader.set_epoch(0)
    iterator = iter(loader)
    next(iterator)
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert _same(_epoch(resumed, 1), _epoch(make(), 1))


def test_order_is_a_function_of_seed_and_epoch() -> None:
    def order(seed: int, epoch: int, shuffle: bool = True) -> list[int]:
        loader = _factory(seed=seed, shuffle=shuffle, drop_last=False)()
        return torch.cat(_epoch(loader, epoch)).flatten().tolist()

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    assert sorted(order(0, 1)) == list(range(SIZE))
    assert order(0, 0, shuffle=False) == order(5, 3, shuffle=False) == list(range(SIZE))


@pytest.mark.parametrize("size", [20, 22, 23])
def test_rank_shards_without_drop_last_cover_the_dataset(size: int) -> None:
    shards = []
    for rank in range(2):
        loader = _factory(dataset=Indices(size), rank=rank, world_size=2, drop_last=False)()
        shards.append(torch.cat(_epoch(loader, 1)).flatten().tolist())
    assert len(shards[0]) == len(shards[1]) == (size + 1) // 2
    assert set(shards[0]) | set(shards[1]) == set(range(size))
    # the shorter shard is padded with a repeat, so the shards are disjoint when size is even
    assert len(set(shards[0]) & set(shards[1])) == size % 2


def test_rank_shards_with_drop_last_are_disjoint_and_equal() -> None:
    shards = []
    for rank in range(2):
        loader = _factory(dataset=Indices(23), rank=rank, world_size=2, drop_last=True)()
        shards.append(torch.cat(_epoch(loader, 0)).flatten().tolist())
        assert len(loader) == 11 // BATCH
    assert len(shards[0]) == len(shards[1]) == 2 * BATCH
    assert not set(shards[0]) & set(shards[1])


def test_packed_text_batches_resume_exactly(small_tokenizer) -> None:
    dataset = PackedTextDataset(small_tokenizer, split="eval", block_size=16, max_files=3)
    collate = CausalLMCollator(pad_token_id=small_tokenizer.pad_token_id)
    make = _factory(dataset=dataset, collate_fn=collate, batch_size=2)
    length = len(make())
    assert length == len(dataset) // 2 > 3
    _check_resume(make, 1, [length // 2])
    batch = next(iter(make()))
    assert batch["input_ids"].shape == (2, 16) and torch.equal(batch["labels"], batch["input_ids"])


def test_incompatible_states_are_refused() -> None:
    loader = _factory()()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    other_seed = _factory(seed=4)()
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(state)
    assert other_seed.next_iter_state is None  # a refused state leaves the loader untouched
    with pytest.raises(ValueError, match="num_replicas"):
        _factory(world_size=2)().load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size"):
        _factory(dataset=Indices(30))().load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers=0"):
        _factory(num_workers=2)().load_state_dict(state)
    with pytest.raises(ValueError, match="not saved by"):
        _factory()().load_state_dict({"something": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"persistent_workers": True}, "persistent_workers"),
        ({"batch_size": 30}, "no batches"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _factory(**kwargs)()


class SlowToArrive(Indices):
    """A worker started with ``spawn`` unpickles its dataset before its ``worker_init_fn``
    runs: this one takes a second to unpickle, holding open the window between a worker's
    start and its first act (which ignores the stop signals)."""

    def __setstate__(self, state: dict) -> None:
        time.sleep(1.0)
        self.__dict__.update(state)


def _signal_each_new_child(signum: int, known: set[int], sent: list[int]) -> None:
    """Send ``signum`` to the first process this process starts (beyond ``known``) as soon as
    it exists, and note its pid in ``sent``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [p.pid for p in multiprocessing.active_children() if p.pid not in known]
        if new:
            os.kill(new[0], signum)
            sent.append(new[0])
            return
        time.sleep(0.01)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_a_worker_still_starting_does_not_kill_it(signum) -> None:
    """A scheduler's stop reaches every process of a job, loader workers included (torchrun
    signals each rank's process group): a worker the signal finds still starting (an evaluation
    or a new epoch starts its workers) holds it until its first act ignores it, instead of dying
    of it and failing its rank before the rank has saved (found as 'DataLoader worker ...
    exited unexpectedly' when SIGTERM reached a two-process job as its evaluation began)."""
    loader = build_dataloader(
        SlowToArrive(8), batch_size=BATCH, seed=3, num_workers=1, multiprocessing_context="spawn"
    )
    known, sent = {p.pid for p in multiprocessing.active_children()}, []
    sender = threading.Thread(target=_signal_each_new_child, args=(signum, known, sent))
    sender.start()
    try:
        batches = list(loader)  # starts the worker, which is signalled while it unpickles
    finally:
        sender.join()
    assert sent, "no worker was started"
    assert sorted(int(i) for batch in batches for i in batch) == list(range(8))
