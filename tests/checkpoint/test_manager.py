"""The checkpoint manager on its own, without a trainer: what a save changes and when (the last
and best checkpoint, rotation, the owner's on_commit), a background commit finished at a
boundary, a failed one raised there, a second save of a step, and a resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint import CheckpointError, Component, ModelWeights, Scope, find_checkpoints
from forge.checkpoint.io import load_torch_state
from forge.checkpoint.layout import kept_reasons
from forge.checkpoint.manager import BestRule, CheckpointManager
from forge.checkpoint.storage import CheckpointStorage, use_storage
from forge.train.topology import Topology
from tests.checkpoint.conftest import Value


@dataclass
class Record:
    """What the manager records of a run's checkpoints (a trainer's state has these fields)."""

    last_checkpoint: str | None = None
    best_checkpoint: str | None = None
    best_metric: float | None = None


class Counter:
    """A component whose state the test changes between saves; it reads what the checkpoint
    being snapshotted records of itself, as the trainer's own counters do."""

    def __init__(self, manager: CheckpointManager | None = None) -> None:
        self.value = 0
        self.manager = manager
        self.recorded: dict = {}

    def state_dict(self) -> dict:
        return {"value": self.value, "recorded": dict(self.manager.recording)}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
        self.recorded = state["recorded"]


def make_manager(ckpt_dir: Path, **options) -> tuple[CheckpointManager, Record, Counter, list]:
    record, committed = Record(), []
    manager = CheckpointManager(
        ckpt_dir,
        Topology(),
        record,
        on_commit=lambda step, epoch, path, metrics: committed.append((step, path.name, metrics)),
        **options,
    )
    counter = Counter(manager)
    torch.manual_seed(0)
    manager.register(Component("model", ModelWeights(nn.Linear(4, 2)), Scope.STAGE, weights=True))
    manager.register(Component("counter", counter))
    manager.register(Component("data", Value({"position": 1}), Scope.RANK))
    return manager, record, counter, committed


def test_a_save_records_the_last_and_best_checkpoint_and_rotates_all_but_the_best(ckpt_dir):
    manager, record, counter, committed = make_manager(
        ckpt_dir, save_total_limit=2, best=BestRule("eval_loss")
    )
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5}
    for step, loss in losses.items():
        counter.value = step
        manager.save(step, epoch=step / 4, metrics={"eval_loss": loss})
    kept = [info.path.name for info in find_checkpoints(ckpt_dir)]
    assert kept == ["checkpoint-000002", "checkpoint-000004"]  # the best survives rotation
    assert record.best_checkpoint.endswith("checkpoint-000002") and record.best_metric == 1.0
    assert record.last_checkpoint.endswith("checkpoint-000004")
    assert [step for step, _, _ in committed] == [1, 2, 3, 4]
    assert committed[1] == (2, "checkpoint-000002", {"eval_loss": 1.0})
    assert manager.improves(0.5) and not manager.improves(1.0)
    assert not manager.improves(float("nan"))


@pytest.mark.parametrize("greater_is_better", [False, True])
def test_the_best_k_survive_rotation_beside_the_newest(ckpt_dir, greater_is_better):
    manager, record, counter, _ = make_manager(
        ckpt_dir, save_total_limit=2, best=BestRule("eval_loss", greater_is_better, keep=3)
    )
    # 20 saves; the metric is best at steps 5, 11 and 17 (in that order), worst at 2
    values = {step: 10.0 + (step % 3) for step in range(1, 21)}
    values.update({5: 1.0, 11: 2.0, 17: 3.0, 2: 50.0, 20: 40.0})
    sign = -1.0 if greater_is_better else 1.0
    for step, value in values.items():
        counter.value = step
        manager.save(step, epoch=None, metrics={"eval_loss": sign * value})
    kept = [info.step for info in find_checkpoints(ckpt_dir)]
    assert kept == [5, 11, 17, 20]  # the best three and the newest
    reasons = kept_reasons(ckpt_dir, "eval_loss", greater_is_better, 3)  # forge checkpoints'
    assert {path.name: why for path, why in reasons.items()} == {
        "checkpoint-000005": "best 1 of 3",
        "checkpoint-000011": "best 2 of 3",
        "checkpoint-000017": "best 3 of 3",
        "checkpoint-000020": "last",
    }
    assert [p.name for p in manager.kept_best()][:3] == [
        "checkpoint-000005",
        "checkpoint-000011",
        "checkpoint-000017",
    ]


def test_a_checkpoint_records_itself_but_the_record_changes_only_after_its_commit(ckpt_dir):
    manager, record, counter, _ = make_manager(ckpt_dir, best=BestRule("acc", True))
    manager.save(1, epoch=0.5, metrics={"acc": 0.7})
    resumed, _, restored, _ = make_manager(ckpt_dir.parent / "other", best=BestRule("acc", True))
    resumed.load(ckpt_dir / "checkpoint-000001")
    assert restored.recorded == {
        "last_checkpoint": str(ckpt_dir / "checkpoint-000001"),
        "best_metric": 0.7,
        "best_checkpoint": str(ckpt_dir / "checkpoint-000001"),
    }
    assert manager.recording == {}  # only while the snapshot is taken
    assert resumed.last_step == 1


def test_a_second_save_of_the_same_step_is_the_first(ckpt_dir):
    manager, _, counter, committed = make_manager(ckpt_dir)
    first = manager.save(5, epoch=1.0, metrics={})
    counter.value = 99
    assert manager.save(5, epoch=1.0, metrics={}) == first
    assert len(committed) == 1


def test_a_background_commit_is_finished_at_a_boundary_and_the_next_save_waits(ckpt_dir):
    manager, record, counter, committed = make_manager(ckpt_dir, async_save=True)
    counter.value = 1
    path = manager.save(1, epoch=0.1, metrics={})
    counter.value = 2  # the snapshot was taken: the checkpoint holds 1
    manager.wait()
    assert committed == [(1, "checkpoint-000001", {})] and record.last_checkpoint == str(path)
    manager.save(2, epoch=0.2, metrics={})
    manager.save(3, epoch=0.3, metrics={})  # waits for step 2's commit first
    while manager.in_flight:
        pass
    manager.poll(synced=False)  # one process: an ended commit is finished at any boundary
    assert [step for step, _, _ in committed] == [1, 2, 3]
    restored, _, again, _ = make_manager(ckpt_dir.parent / "other")
    restored.load(ckpt_dir / "checkpoint-000001")
    assert again.value == 1


class FailingWrites(CheckpointStorage):
    def write_torch(self, path, obj, *, hash_algorithm=None):
        raise OSError(5, "Input/output error")


def test_a_failed_background_commit_is_raised_at_the_next_boundary_and_changes_no_record(
    ckpt_dir,
):
    manager, record, _, committed = make_manager(ckpt_dir, async_save=True)
    manager.save(1, epoch=0.1, metrics={})
    manager.wait()
    previous = use_storage(FailingWrites())
    try:
        manager.save(2, epoch=0.2, metrics={})
        while manager.in_flight:
            pass
        with pytest.raises(
            CheckpointError, match="could not write counter.pt of checkpoint .*checkpoint-000002"
        ):
            manager.poll(synced=False)
    finally:
        use_storage(previous)
    assert record.last_checkpoint.endswith("checkpoint-000001")
    assert [step for step, _, _ in committed] == [1]
    assert [info.path.name for info in find_checkpoints(ckpt_dir)] == ["checkpoint-000001"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_view_is_written_as_its_own_bytes_not_its_whole_storage(ckpt_dir, async_save):
    """One rank's rows of a moment loaded whole are a view of every rank's rows: torch.save
    would write the whole storage. A save writes the view's bytes alone, as a compact copy of
    the same state would be written."""
    whole = torch.randn(256, 64)
    manager, *_ = make_manager(ckpt_dir, async_save=async_save)
    manager.register(Component("moments", Value({"exp_avg": whole[:128]})))
    manager.register(Component("copy", Value({"exp_avg": whole[:128].clone()})))
    manager.save(1, epoch=0.0, metrics={})
    manager.wait()
    checkpoint = ckpt_dir / "checkpoint-000001"
    written, compact = (checkpoint / "moments.pt").stat().st_size, (checkpoint / "copy.pt").stat()
    assert written == pytest.approx(compact.st_size, abs=64)
    assert written < 0.6 * whole.numel() * whole.element_size()
    saved = load_torch_state(checkpoint / "moments.pt")["state"]["exp_avg"]
    assert torch.equal(saved, whole[:128])


def test_the_rollback_anchor_survives_rotation_until_a_newer_one_takes_its_place(ckpt_dir):
    manager, _, counter, _ = make_manager(ckpt_dir, save_total_limit=1, anchor_before=5)
    for step in range(2, 21, 2):
        counter.value = step
        manager.save(step, epoch=None, metrics={})
        kept = [info.step for info in find_checkpoints(ckpt_dir)]
        # a rollback asked from now on restores the newest at or before its step - 5: the
        # newest at or before this step - 5 and every later one stay; older ones go
        anchor = max([s for s in range(2, step + 1, 2) if s <= step - 5], default=2)
        assert kept == list(range(anchor, step + 1, 2)), step
    reasons = kept_reasons(ckpt_dir, anchor_before=5)  # forge checkpoints'
    assert {path.name: why for path, why in reasons.items()} == {
        "checkpoint-000014": "rollback anchor",
        "checkpoint-000016": "rollback anchor",
        "checkpoint-000018": "rollback anchor",
        "checkpoint-000020": "last, rollback anchor",
    }
