"""The writer's meetings: a failure on any rank, at any stage of a save, ends the save on
every rank with an error (the failing rank's own, the others' "another rank failed"), and no
rank waits for one that has given up. Ranks are threads here; their meeting is the same
"did anyone fail?" exchange the trainer runs as an all-reduce."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from forge.checkpoint import CheckpointError, CheckpointWriter, find_checkpoints
from tests.faults import FaultyStorage


class Meeting:
    """``any_failed`` for ``world_size`` thread-ranks, counting how often each rank met."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.failed = [False] * world_size
        self.meetings = [0] * world_size

    def for_rank(self, rank: int):
        def any_failed(failed: bool) -> bool:
            self.meetings[rank] += 1
            self.failed[rank] = failed
            self.barrier.wait()
            result = any(self.failed)
            self.barrier.wait()  # everyone has read before the next meeting writes
            return result

        return any_failed


def run_ranks(
    checkpoints: Path, body, world_size: int = 2, fail: str | None = None
) -> list[BaseException | None]:
    """Save step 5 on every thread-rank; ``body(writer, rank)`` writes; returns each error.
    ``fail``: a fault spec (tests/faults) every rank's storage knows."""
    meeting = Meeting(world_size)
    errors: list[BaseException | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            with CheckpointWriter(
                checkpoints,
                5,
                rank=rank,
                world_size=world_size,
                any_failed=meeting.for_rank(rank),
                storage=FaultyStorage(fail=fail, rank=rank),
            ) as writer:
                body(writer, rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    assert meeting.meetings == [3] * world_size or any(errors), meeting.meetings
    return errors


def write_rank_file(writer: CheckpointWriter, rank: int) -> None:
    writer.save_torch(f"rng-rank-{rank:05d}.pt", {"x": torch.arange(3)})


def assert_nothing_saved(checkpoints: Path) -> None:
    assert find_checkpoints(checkpoints) == []
    assert [p.name for p in checkpoints.iterdir()] == []


def test_every_rank_saves_when_none_fails(tmp_path):
    errors = run_ranks(tmp_path, write_rank_file)
    assert errors == [None, None]
    (saved,) = find_checkpoints(tmp_path)
    assert saved.step == 5


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_write_on_one_rank_fails_the_save_on_every_rank(tmp_path, failing):
    fail = f"after:rng-rank-{failing:05d}.pt@5:{failing}"
    errors = run_ranks(tmp_path, write_rank_file, fail=fail)
    own, other = errors[failing], errors[1 - failing]
    assert isinstance(own, CheckpointError)
    assert f"could not write rng-rank-{failing:05d}.pt of checkpoint" in str(own)
    assert isinstance(other, CheckpointError)
    assert "another rank failed while writing it" in str(other)
    assert_nothing_saved(tmp_path)


def test_an_error_that_is_not_a_write_is_passed_on_unchanged(tmp_path):
    def body(writer, rank):
        if rank == 1:
            raise KeyError("no such state")
        write_rank_file(writer, rank)

    errors = run_ranks(tmp_path, body)
    assert isinstance(errors[1], KeyError)
    assert "another rank failed while writing it" in str(errors[0])
    assert_nothing_saved(tmp_path)


def test_a_failed_commit_on_rank_0_fails_the_save_on_every_rank(tmp_path):
    errors = run_ranks(tmp_path, write_rank_file, fail="before-manifest@5:0")
    assert "could not commit checkpoint" in str(errors[0])
    assert isinstance(errors[1], CheckpointError)
    assert "another rank failed while committing it" in str(errors[1])
    assert_nothing_saved(tmp_path)


def test_a_failed_start_on_rank_0_fails_the_save_on_every_rank(tmp_path):
    blocked = tmp_path / "checkpoints"
    blocked.write_text("a file where the directory should be")
    errors = run_ranks(blocked, write_rank_file)
    assert isinstance(errors[0], CheckpointError)
    assert "could not start checkpoint" in str(errors[0])
    assert "another rank failed while starting it" in str(errors[1])


def test_an_interrupt_inside_the_save_ends_it_without_a_meeting(tmp_path):
    meetings = []

    def any_failed(failed):
        meetings.append(failed)
        return failed

    with pytest.raises(KeyboardInterrupt):
        with CheckpointWriter(tmp_path, 5, world_size=2, any_failed=any_failed) as writer:
            write_rank_file(writer, 0)
            raise KeyboardInterrupt
    assert meetings == [False]  # the start only: the job is ending, no rank is waited for
    assert_nothing_saved(tmp_path)
