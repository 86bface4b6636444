"""``async_save``: the commit runs on a background thread while the loop trains on.

What an async save writes is what a synchronous save of the same step writes (the snapshot
is a copy: the optimizer steps that follow change the live tensors in place); ``on_save`` and
``run.json`` see the snapshot's step and metrics; a commit that fails fails the run with the
writer's message and changes nothing a committed save changes; a stop by signal waits for the
commit in flight.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from forge.checkpoint import (
    CheckpointError,
    find_checkpoints,
    load_torch_state,
    read_manifest,
    validate_checkpoint,
)
from forge.checkpoint.background import BackgroundCommit
from forge.launch.worker import make_run_record_callback
from forge.runs import RunRecord
from forge.train import TrainerCallback, TrainingArgumentsError
from forge.train.signals import TrainingInterrupted
from tests.faults import inject
from tests.train.common import SignalAtStep, assert_same_tensors, make_args, make_trainer
from tests.train.test_save_phases import (
    FAULTED,
    LIMIT,
    SAVE_STEPS,
    KeepsWhatSaveChanged,
    Rounds,
    assert_earlier_checkpoints_load,
    assert_nothing_changed,
)


class SeenOnSave(TrainerCallback):
    """The step and metrics ``on_save`` was given, and the step the loop is at meanwhile."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, dict]] = []
        self.threads: set[str] = set()

    def on_save(self, args, state, control, checkpoint_path=None, metrics=None, **kwargs):
        self.calls.append((state.global_step, Path(checkpoint_path).name, dict(metrics or {})))
        self.threads.add(threading.current_thread().name)


def _run(run_dir: Path, *, async_save: bool, max_steps: int = 12, callbacks=(), **overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "run.json").exists():
        RunRecord(run_dir, {"run": 1, "status": "running"}).save()
    args = make_args(
        run_dir,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        eval_strategy="steps",
        eval_steps=SAVE_STEPS,
        metric_for_best_model="round",
        async_save=async_save,
        **overrides,
    )
    callbacks = [make_run_record_callback(RunRecord.load(run_dir)), *callbacks]
    return make_trainer(args, eval_size=8, compute_metrics=Rounds(), callbacks=callbacks)


def _state_files(checkpoint: Path) -> dict[str, dict]:
    names = [n for n in read_manifest(checkpoint).files if n.endswith(".pt")]
    return {n: load_torch_state(checkpoint / n) for n in names}


def test_async_saves_write_what_sync_saves_write(tmp_path):
    seen = SeenOnSave()
    synced = _run(tmp_path / "sync", async_save=False)
    synced.train()
    background = _run(tmp_path / "async", async_save=True, callbacks=[seen])
    background.train()
    sync_ckpts = find_checkpoints(tmp_path / "sync" / "checkpoints")
    async_ckpts = find_checkpoints(tmp_path / "async" / "checkpoints")
    assert [c.step for c in async_ckpts] == [c.step for c in sync_ckpts] == [4, 8, 12]
    for ours, theirs in zip(async_ckpts, sync_ckpts, strict=True):
        assert validate_checkpoint(ours.path, verify_hashes=True) == []
        mine, reference = read_manifest(ours.path), read_manifest(theirs.path)
        # the weights are byte for byte the synchronous save's
        assert mine.files["model.safetensors"] == reference.files["model.safetensors"]
        for name, state in _state_files(theirs.path).items():
            assert_same_tensors(
                _tensors(state), _tensors(_state_files(ours.path)[name]), f"{ours.path.name}/{name}"
            )
        for name in ("eval_round", "eval_loss"):  # the same evaluation (timings aside)
            assert mine.metrics[name] == reference.metrics[name]
    # on_save saw each checkpoint's own step and evaluation, not where the loop was by then
    assert [(step, name) for step, name, _ in seen.calls] == [
        (4, "checkpoint-000004"),
        (8, "checkpoint-000008"),
        (12, "checkpoint-000012"),
    ]
    assert [metrics["eval_round"] for _, _, metrics in seen.calls] == [1.0, 2.0, 3.0]
    # callbacks run in the training thread, never on the commit's
    assert seen.threads == {threading.current_thread().name}
    record = RunRecord.load(tmp_path / "async").data
    assert [c["step"] for c in record["checkpoints"]] == [4, 8, 12]
    assert record["best"]["checkpoint"] == "checkpoints/checkpoint-000012"
    state = background.state
    assert state.last_checkpoint == str(async_ckpts[-1].path)
    assert state.best_checkpoint == str(async_ckpts[-1].path)


def _tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, by its path."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        for key, value in state.items():
            found.update(_tensors(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            found.update(_tensors(value, f"{prefix}/{i}"))
    return found


@pytest.mark.parametrize("point", ["start", "before-rename"])
def test_an_async_save_that_fails_fails_the_run_and_changes_nothing(tmp_path, monkeypatch, point):
    run_dir = tmp_path / "run"
    keeper = KeepsWhatSaveChanged(run_dir)
    trainer = _run(run_dir, async_save=True, callbacks=[keeper], save_total_limit=LIMIT)
    inject(monkeypatch, fail=f"{point}@{FAULTED}")
    with pytest.raises(CheckpointError, match=f"injected at {point} of step {FAULTED}"):
        trainer.train()
    before = keeper.seen[8]
    assert FAULTED not in keeper.seen  # on_save was not called
    state = trainer.state
    assert (state.last_checkpoint, state.best_checkpoint, state.best_metric) == before["loop"]
    assert_nothing_changed(run_dir, before)
    assert not trainer.checkpoints.in_flight
    monkeypatch.undo()
    assert_earlier_checkpoints_load(run_dir)


def test_an_async_failure_mid_run_stops_the_loop_at_the_next_step(tmp_path, monkeypatch):
    """The save at step 4 fails in the background: the run ends with its error, long before
    ``max_steps``, and never writes a later checkpoint."""
    run_dir = tmp_path / "run"
    trainer = _run(run_dir, async_save=True, max_steps=40)
    inject(monkeypatch, fail="before-rename@4")
    with pytest.raises(CheckpointError, match="injected at before-rename of step 4"):
        trainer.train()
    assert trainer.state.global_step <= 8  # at the latest the next save's wait raised it
    assert find_checkpoints(run_dir / "checkpoints") == []
    assert sorted(os.listdir(run_dir / "checkpoints")) == []


def test_a_signal_waits_for_the_async_commit(tmp_path):
    run_dir = tmp_path / "run"
    trainer = _run(run_dir, async_save=True, max_steps=40, callbacks=[SignalAtStep(6)])
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer.train()
    assert stopped.value.signum == signal.SIGTERM
    checkpoint = Path(stopped.value.checkpoint)
    assert checkpoint.name == "checkpoint-000006"
    assert validate_checkpoint(checkpoint, verify_hashes=True) == []  # committed before exit
    steps = [c.step for c in find_checkpoints(run_dir / "checkpoints")]
    assert steps == [4, 6]


def test_async_save_is_on_unless_chosen_off_or_under_fsdp(tmp_path):
    assert make_args(tmp_path).async_save is True
    assert make_args(tmp_path, async_save=False).async_save is False
    sharded = make_args(tmp_path, fsdp="full_shard")
    assert sharded.async_save is False  # fsdp's saves are synchronous: the default follows


def test_async_save_must_be_a_boolean(tmp_path):
    with pytest.raises(TrainingArgumentsError, match="async_save must be true or false"):
        make_args(tmp_path, async_save="yes")


def test_the_next_commit_waits_for_the_one_in_flight():
    import threading

    order: list[str] = []
    release = threading.Event()
    commits = BackgroundCommit()

    def first() -> None:
        release.wait()
        order.append("first")

    commits.submit(first)
    assert commits.in_flight
    threading.Timer(0.05, release.set).start()
    commits.submit(lambda: order.append("second"))  # blocks until the first is done
    commits.wait()
    assert order == ["first", "second"]


def test_a_failed_background_commit_is_raised_once():
    commits = BackgroundCommit()

    def fail() -> None:
        raise CheckpointError("disk on fire")

    commits.submit(fail)
    with pytest.raises(CheckpointError, match="disk on fire"):
        commits.wait()
    commits.wait()  # reported: not again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs CUDA")
def test_pinned_staging_buffers_are_reused_and_hold_the_snapshot():
    from forge.checkpoint.snapshot import HostStaging, host_copy

    staging = HostStaging()
    live = {"w": torch.arange(1024.0, device="cuda"), "t": torch.ones(8, device="cuda")}
    first = host_copy(live, staging)
    assert first["w"].is_pinned() and first["w"].device.type == "cpu"
    live["w"].add_(1.0)  # the next optimizer step
    assert torch.equal(first["w"], torch.arange(1024.0))
    pointer = first["w"].data_ptr()
    staging.reuse()  # the commit of ``first`` is done
    second = host_copy(live, staging)
    assert second["w"].data_ptr() == pointer  # the same pinned buffer, not a new one
    assert torch.equal(second["w"], torch.arange(1024.0) + 1)


def test_deferred_copies_hold_the_state_at_the_snapshot():
    """Parameters and moments (changed only by the optimizer step) are copied on the commit
    thread; everything else (a buffer the forward changes) at once."""
    import threading

    from forge.checkpoint.snapshot import HostCopier, host_copy, stepped_by

    model = torch.nn.BatchNorm1d(4)  # a weight, a bias and running statistics (buffers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    deferrable = stepped_by(optimizer)
    assert all(deferrable(p) for p in model.parameters())
    assert all(deferrable(t) for s in optimizer.state.values() for t in s.values())
    assert not any(deferrable(b) for b in model.buffers())

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    copier = HostCopier(deferrable=deferrable)
    snapshot = host_copy(model.state_dict(), copier)
    model(torch.randn(8, 4))  # the next forward: running statistics change in place
    thread = threading.Thread(target=copier.copy_deferred)
    thread.start()
    copier.wait_copied()  # what the next optimizer step does first
    optimizer.step()
    thread.join()
    assert_same_tensors(expected, snapshot, "snapshot")


def test_a_failed_deferred_copy_never_blocks_the_loop():
    from forge.checkpoint.snapshot import HostCopier, host_copy

    source = torch.arange(4.0)
    copier = HostCopier(deferrable=lambda t: True)
    host_copy({"w": source}, copier)
    copier._deferred.append((torch.empty(3), source))  # a copy that fails (shapes differ)
    with pytest.raises(RuntimeError):
        copier.copy_deferred()
    copier.wait_copied()  # returns: the failure reaches the loop through the commit instead


class Events(TrainerCallback):
    """The order of on_save and on_train_end."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_save(self, args, state, control, checkpoint_path=None, **kwargs):
        self.events.append(f"save {Path(checkpoint_path).name}")

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("train_end")


def test_on_a_signal_the_stops_checkpoint_is_saved_before_training_ends(tmp_path):
    """The checkpoint a signal saves in the background is committed, and its on_save run,
    before on_train_end: a callback that closes its files there has recorded it first."""
    events = Events()
    trainer = _run(
        tmp_path / "run", async_save=True, max_steps=40, callbacks=[SignalAtStep(6), events]
    )
    with pytest.raises(TrainingInterrupted):
        trainer.train()
    assert events.events[-2:] == ["save checkpoint-000006", "train_end"], events.events


def test_the_optimizer_step_waits_for_a_slow_deferred_copy(tmp_path, monkeypatch):
    """An async save copies the parameters and moments on the commit thread while the loop
    runs the next forward and backward; the next optimizer step must wait for those copies.
    A copy made slow here (it would lose a race with any step otherwise) must still hold the
    state of its step: the async checkpoints equal the synchronous run's."""
    from forge.checkpoint.snapshot import HostCopier

    copy_deferred = HostCopier.copy_deferred

    def slow(self):
        threading.Event().wait(0.3)  # the loop reaches the next optimizer step first
        copy_deferred(self)

    monkeypatch.setattr(HostCopier, "copy_deferred", slow)
    _run(tmp_path / "sync", async_save=False).train()
    _run(tmp_path / "async", async_save=True).train()
    for step in (4, 8, 12):
        name = f"checkpoint-{step:06d}"
        sync, background = (tmp_path / run / "checkpoints" / name for run in ("sync", "async"))
        weights = "model.safetensors"
        assert read_manifest(sync).files[weights] == read_manifest(background).files[weights]
        for file, state in _state_files(sync).items():
            assert_same_tensors(
                _tensors(state), _tensors(_state_files(background)[file]), f"{name}/{file}"
            )
