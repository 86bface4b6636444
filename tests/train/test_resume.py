"""Exact resume: straight training and stop + resume give bit-identical weights and optimizer."""

from __future__ import annotations

import shutil
import signal

import pytest
import torch

from forge.checkpoint import CheckpointError, read_manifest, validate_checkpoint
from forge.train import TrainingInterrupted
from tests.train.common import (
    SignalAtStep,
    StopAfterSave,
    assert_same_training,
    checkpoint_dir,
    make_args,
    make_trainer,
)

# 116 samples / batch 4 = 29 micro-batches per epoch; with accumulation 2 that is 14 full
# windows and one short one: 15 steps per epoch. Step 20 is mid-epoch 1, step 15 ends epoch 0,
# and 40 steps cross two epoch boundaries.
TRAIN_SIZE = 116


def resume_args(output_dir, **overrides):
    values = dict(
        max_steps=40,
        gradient_accumulation_steps=2,
        warmup_steps=5,
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=10,
        eval_strategy="steps",
        eval_steps=10,
        logging_steps=5,
    )
    values.update(overrides)
    return make_args(output_dir, **values)


def train_straight(output_dir, **overrides):
    trainer = make_trainer(
        resume_args(output_dir, **overrides), train_size=TRAIN_SIZE, eval_size=16
    )
    trainer.output = trainer.train()
    return trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 40-step run every linear-schedule variant is compared against."""
    return train_straight(tmp_path_factory.mktemp("straight"))


def test_sigterm_mid_epoch_then_resume_is_bit_identical(straight, tmp_path):
    out = tmp_path / "run"
    first = make_trainer(
        resume_args(out), train_size=TRAIN_SIZE, eval_size=16, callbacks=[SignalAtStep(20)]
    )
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as info:
        first.train()
    assert info.value.signum == signal.SIGTERM
    assert info.value.step == 20
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    ckpt = checkpoint_dir(out, 20)
    assert ckpt.is_dir() and validate_checkpoint(ckpt) == []
    assert not checkpoint_dir(out, 30).exists()
    assert 1 < read_manifest(ckpt).epoch < 2  # mid-epoch

    resumed = make_trainer(resume_args(out), train_size=TRAIN_SIZE, eval_size=16)
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == 40
    assert resumed.state.resumed_from == str(ckpt)
    assert_same_training(straight, resumed)


def test_resume_at_an_epoch_boundary_is_bit_identical(straight, tmp_path):
    """Stopped by a step checkpoint right after epoch 0's last (short) window."""
    out = tmp_path / "run"
    first = make_trainer(
        resume_args(out), train_size=TRAIN_SIZE, eval_size=16, callbacks=[SignalAtStep(15)]
    )
    with pytest.raises(TrainingInterrupted):
        first.train()
    ckpt = checkpoint_dir(out, 15)
    assert read_manifest(ckpt).epoch == 1.0
    resumed = make_trainer(resume_args(out), train_size=TRAIN_SIZE, eval_size=16)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert_same_training(straight, resumed)


def test_resume_from_an_epoch_end_checkpoint_with_cosine_is_bit_identical(tmp_path):
    """save_strategy epoch: the checkpoint is written after the epoch's loader is exhausted."""
    overrides = dict(lr_scheduler_type="cosine", save_strategy="epoch", eval_strategy="epoch")
    straight = train_straight(tmp_path / "straight", **overrides)
    out = tmp_path / "run"
    first = make_trainer(
        resume_args(out, **overrides, async_save=False),
        train_size=TRAIN_SIZE,
        eval_size=16,
        callbacks=[StopAfterSave(15)],
    )
    first.train()
    assert first.state.global_step == 15
    resumed = make_trainer(resume_args(out, **overrides), train_size=TRAIN_SIZE, eval_size=16)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(straight, resumed)


def test_resume_true_finds_a_sibling_runs_checkpoint(straight, tmp_path):
    """forge's layout output/<config>/run_NNN: a new run resumes from the previous run."""
    old, new = tmp_path / "cfg" / "run_001", tmp_path / "cfg" / "run_002"
    first = make_trainer(
        resume_args(old), train_size=TRAIN_SIZE, eval_size=16, callbacks=[SignalAtStep(20)]
    )
    with pytest.raises(TrainingInterrupted):
        first.train()
    resumed = make_trainer(
        resume_args(new, resume_from_checkpoint=True), train_size=TRAIN_SIZE, eval_size=16
    )
    resumed.train()
    assert resumed.state.resumed_from == str(checkpoint_dir(old, 20))
    assert checkpoint_dir(new, 40).is_dir()
    assert_same_training(straight, resumed)


def test_checkpoint_files_load_with_weights_only(straight):
    ckpt = checkpoint_dir(straight.args.output_dir, 20)
    manifest = read_manifest(ckpt)
    assert manifest.trainer == "plain"
    assert {"model", "optimizer", "lr_scheduler", "trainer", "callbacks", "data", "rng"} <= set(
        manifest.components
    )
    for name, entry in manifest.components.items():
        for file in entry["files"]:
            if file.endswith(".pt"):
                payload = torch.load(ckpt / file, weights_only=True)
                assert payload["forge_component"]["name"] == name
                assert payload["forge_component"]["step"] == 20
    state = torch.load(ckpt / "trainer.pt", weights_only=True)["state"]
    assert state["global_step"] == 20
    assert state["position"]["epoch"] == 1
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    assert any(key.startswith("state.") and key.endswith(".exp_avg") for key in optimizer)
    assert {"rng", "data"} == {n for n, e in manifest.components.items() if e["scope"] == "rank"}
    assert manifest.topology["world_size"] == 1
    assert "eval_loss" in manifest.metrics


def test_resume_from_an_invalid_checkpoint_names_the_problem(straight, tmp_path):
    broken = tmp_path / "checkpoint-000020"
    shutil.copytree(checkpoint_dir(straight.args.output_dir, 20), broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(100)
    trainer = make_trainer(resume_args(tmp_path / "run"), train_size=TRAIN_SIZE, eval_size=16)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        trainer.train(resume_from_checkpoint=str(broken))


def test_resume_true_without_checkpoints_warns_and_starts_fresh(tmp_path, caplog):
    trainer = make_trainer(make_args(tmp_path / "run", max_steps=2), train_size=16)
    output = trainer.train(resume_from_checkpoint=True)
    assert output.global_step == 2
    assert trainer.state.resumed_from is None
    assert "no valid checkpoint" in caplog.text


def test_restore_flags_off_still_continue_from_the_step(straight, tmp_path):
    """Weights and step come back; optimizer, scheduler, data and rng start fresh."""
    out = tmp_path / "run"
    shutil.copytree(checkpoint_dir(straight.args.output_dir, 20), checkpoint_dir(out, 20))
    args = resume_args(
        out,
        restore_optimizer_state=False,
        restore_scheduler_state=False,
        restore_rng_state=False,
        restore_dataloader_state=False,
        max_steps=22,
    )
    trainer = make_trainer(args, train_size=TRAIN_SIZE, eval_size=16)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 22
    # a fresh AdamW has taken 2 steps only
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {2}


def test_resume_with_loader_worker_processes_is_bit_identical(tmp_path):
    straight = train_straight(tmp_path / "straight", dataloader_num_workers=2)
    out = tmp_path / "run"
    args = resume_args(out, dataloader_num_workers=2)
    first = make_trainer(args, train_size=TRAIN_SIZE, eval_size=16, callbacks=[SignalAtStep(20)])
    with pytest.raises(TrainingInterrupted):
        first.train()
    resumed = make_trainer(
        resume_args(out, dataloader_num_workers=2), train_size=TRAIN_SIZE, eval_size=16
    )
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(straight, resumed)


def test_resuming_a_finished_run_from_its_directory_trains_no_further(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight.args.output_dir, out)
    lines = (out / "metrics.jsonl").read_text()
    trainer = make_trainer(resume_args(out), train_size=TRAIN_SIZE, eval_size=16)
    output = trainer.train(resume_from_checkpoint=str(out))  # a run directory: its newest
    assert output.global_step == 40
    assert trainer.state.resumed_from == str(checkpoint_dir(out, 40))
    assert (out / "metrics.jsonl").read_text() == lines  # nothing evaluated or logged again
    assert_same_training(straight, trainer)


def test_a_resumed_run_reports_the_training_loss_of_the_straight_run(straight, tmp_path):
    """train_loss (and what train() returns) is the mean over every step of the run, the
    steps before the resume included, as the straight run reports it."""
    out = tmp_path / "run"
    first = make_trainer(
        resume_args(out), train_size=TRAIN_SIZE, eval_size=16, callbacks=[SignalAtStep(20)]
    )
    with pytest.raises(TrainingInterrupted):
        first.train()
    resumed = make_trainer(resume_args(out), train_size=TRAIN_SIZE, eval_size=16)
    output = resumed.train(resume_from_checkpoint=True)
    assert straight.state.global_step == output.global_step == 40
    expected = straight.output.training_loss
    assert output.training_loss == pytest.approx(expected, rel=1e-12)
    assert output.metrics["train_loss"] == pytest.approx(expected, rel=1e-12)


def test_a_plain_sgd_run_resumes_bit_identical(tmp_path):
    """SGD without momentum keeps no optimizer state: its checkpoint still holds the learning
    rate the schedule set, which the first resumed step uses (loading the schedule's own state
    does not set it)."""
    from forge.train import Trainer
    from tests.train.test_divergence import SMALL_RUN, LinearModel, Regression

    def trainer(out, **overrides):
        values = {**SMALL_RUN, "max_steps": 10, "save_strategy": "steps", "save_steps": 4}
        values.update(lr_scheduler_type="linear", **overrides)
        torch.manual_seed(0)
        return Trainer(LinearModel, make_args(out, **values), Regression())

    straight = trainer(tmp_path / "a")
    straight.train()
    resumed = trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(checkpoint_dir(tmp_path / "a", 4)))
    assert_same_training(straight, resumed)
