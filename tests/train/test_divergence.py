"""Divergence detectors: each kind fires at the step a rigged run spikes, warn and stop act, and
a resumed run detects what the straight run does."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from forge.train import (
    DivergenceDetector,
    GradNormSpike,
    LossSpike,
    MetricRise,
    NonFiniteStreak,
    SustainedRise,
    Trainer,
)
from forge.train.callbacks import TrainerCallback, is_train_summary
from tests.train.common import assert_same_tensors, checkpoint_dir, make_args

SPIKE_AT = 12  # the learning rate jumps after this many steps
# step 13 is the first with the jumped learning rate; step 14's loss is the first it blew up
BLOWN_AT = SPIKE_AT + 2


class Regression(Dataset):
    """A linear target, ``x @ w``; a plain model learns it smoothly at a small learning rate."""

    def __init__(self, n: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


class LinearModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": ((self.linear(x).squeeze(-1) - y) ** 2).mean()}


def jump_at(step: int, factor: float):
    """A schedule whose learning rate is ``factor`` times larger after ``step`` steps."""
    return lambda optimizer, total: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: factor if s >= step else 1.0
    )


# a plain SGD regression, logged at every step; unclipped, so a bad step blows the loss up at once
SMALL_RUN = dict(
    logging_steps=1,
    learning_rate=0.05,
    per_device_train_batch_size=16,
    max_grad_norm=0.0,
    optim="sgd",
)


def spiking_trainer(output_dir, detector, *, factor=1e3, eval_size=0, **overrides):
    values = {**SMALL_RUN, "max_steps": 40, "skip_nonfinite": True, **overrides}
    torch.manual_seed(0)
    return Trainer(
        LinearModel,
        make_args(output_dir, **values),
        Regression(),
        eval_dataset=Regression(eval_size) if eval_size else None,
        lr_scheduler=jump_at(SPIKE_AT, factor),
        callbacks=[detector],
    )


def test_the_default_detector_stops_at_the_spike_with_a_checkpoint(tmp_path, caplog):
    detector = DivergenceDetector()
    trainer = spiking_trainer(tmp_path, detector)
    with caplog.at_level(logging.ERROR, logger="forge.train.divergence"):
        trainer.train()
    assert detector.diverged["detector"] == "LossSpike"
    assert detector.diverged["step"] == BLOWN_AT
    assert trainer.state.global_step == BLOWN_AT  # stopped there, not at max_steps
    assert checkpoint_dir(tmp_path, BLOWN_AT).is_dir()  # the stop saved it
    assert "divergence (LossSpike) at step 14" in caplog.text


def test_a_healthy_run_is_left_alone(tmp_path):
    detector = DivergenceDetector(
        [LossSpike(), SustainedRise(window=5), GradNormSpike(), NonFiniteStreak(steps=2)]
    )
    trainer = spiking_trainer(tmp_path, detector, factor=1.0)
    trainer.train()
    assert detector.diverged is None
    assert trainer.state.global_step == 40


@pytest.mark.parametrize(
    ("detector", "factor", "step"),
    [
        (LossSpike(factor=None, zscore=6.0), 1e3, BLOWN_AT),
        # the slow average still holds the first steps' larger norms: one step more
        (GradNormSpike(), 1e3, BLOWN_AT + 1),
        # a learning rate 30x too high: the loss climbs over a few steps and never comes back
        (SustainedRise(window=3, factor=1.5), 30.0, None),
        (NonFiniteStreak(steps=3), 1e12, None),
    ],
    ids=["zscore", "grad-norm", "sustained", "non-finite"],
)
def test_each_detector_fires_once_the_run_diverges(tmp_path, detector, factor, step):
    callback = DivergenceDetector([detector])
    spiking_trainer(tmp_path, callback, factor=factor).train()
    found = callback.diverged
    assert found is not None and found["detector"] == type(detector).__name__
    if step is not None:
        assert found["step"] == step
    else:
        assert SPIKE_AT < found["step"] < 40


def test_a_non_finite_streak_counts_skipped_steps(tmp_path):
    callback = DivergenceDetector([NonFiniteStreak(steps=3)])
    spiking_trainer(tmp_path, callback, factor=1e12).train()
    assert callback.diverged["step"] - callback.diverged["value"] != 0  # the loss is nan
    assert math.isnan(callback.diverged["value"])
    assert "3 steps in a row" in callback.diverged["message"]


def test_an_evaluation_metric_that_rises_stops_the_run(tmp_path):
    callback = DivergenceDetector([MetricRise("eval_loss", patience=2)])
    trainer = spiking_trainer(
        tmp_path, callback, factor=30.0, eval_size=16, eval_strategy="steps", eval_steps=2
    )
    trainer.train()
    assert callback.diverged["detector"] == "MetricRise"
    assert callback.diverged["step"] > SPIKE_AT and callback.diverged["step"] % 2 == 0


def test_warn_logs_once_and_trains_on(tmp_path, caplog):
    callback = DivergenceDetector(action="warn")
    trainer = spiking_trainer(tmp_path, callback)
    with caplog.at_level(logging.WARNING, logger="forge.train.divergence"):
        trainer.train()
    assert trainer.state.global_step == 40 and callback.diverged is None
    assert caplog.text.count("divergence (LossSpike) at step 14") == 1


def test_a_resumed_run_detects_what_the_straight_run_does(tmp_path):
    straight = DivergenceDetector([LossSpike(warmup=3), SustainedRise(window=4, factor=1.5)])
    spiking_trainer(tmp_path / "a", straight, factor=30.0).train()
    assert straight.diverged is not None
    # the same run, saved at step 8 and resumed from there with fresh detectors
    first = DivergenceDetector([LossSpike(warmup=3), SustainedRise(window=4, factor=1.5)])
    spiking_trainer(
        tmp_path / "b", first, factor=30.0, max_steps=8, save_steps=8, save_strategy="steps"
    ).train()
    resumed = DivergenceDetector([LossSpike(warmup=3), SustainedRise(window=4, factor=1.5)])
    spiking_trainer(tmp_path / "b", resumed, factor=30.0).train(
        resume_from_checkpoint=str(checkpoint_dir(tmp_path / "b", 8))
    )
    assert resumed.diverged == straight.diverged


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DivergenceDetector(action="explode"), "action must be one of warn, stop"),
        (lambda: LossSpike(factor=0.5), "factor must be a number above 1"),
        (lambda: LossSpike(fast=0.01, slow=0.1), "slow (0.1) must be below fast (0.01)"),
        (lambda: LossSpike(factor=None), "give factor, zscore or limit"),
        (lambda: LossSpike(factor=20), "factor (20) must be below fast / slow (10)"),
        (lambda: SustainedRise(window=0), "window must be a positive integer"),
        (lambda: MetricRise(patience=-1), "patience must be a positive integer"),
        (lambda: DivergenceDetector(["loss"]), "detectors must be forge.train detectors"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_a_detector_of_a_metric_the_run_never_produces_is_refused_when_built(tmp_path):
    from forge.train import TrainingArgumentsError

    with pytest.raises(TrainingArgumentsError) as info:
        spiking_trainer(
            tmp_path, DivergenceDetector([LossSpike(), MetricRise("eval_loss")]), eval_size=0
        )
    (problem,) = info.value.problems
    assert problem.startswith("trainer.callbacks[0] (DivergenceDetector): MetricRise watches")
    assert "never evaluates" in problem
    with pytest.raises(TrainingArgumentsError, match='logging_strategy is "no"'):
        spiking_trainer(tmp_path, DivergenceDetector(), logging_strategy="no")


def test_an_evaluation_metric_the_evaluation_does_not_give_fails_the_sanity_pass(tmp_path):
    """A misspelled evaluation metric fails before training, with the near name (the sanity
    pass's evaluation batches show what the evaluation gives)."""
    from forge.train.sanity import SanityFailure, run_sanity_pass

    trainer = spiking_trainer(
        tmp_path,
        DivergenceDetector([MetricRise("eval_los")]),
        eval_size=16,
        eval_strategy="steps",
        eval_steps=2,
    )
    with pytest.raises(SanityFailure) as info:
        run_sanity_pass(trainer, 1)
    assert info.value.part == "callbacks"
    message = str(info.value.error)
    assert "MetricRise watches 'eval_los'" in message and "did you mean 'eval_loss'?" in message
    right = spiking_trainer(
        tmp_path / "right",
        DivergenceDetector([MetricRise("eval_loss")]),
        eval_size=16,
        eval_strategy="steps",
        eval_steps=2,
    )
    run_sanity_pass(right, 1)  # the metric it gives passes


class PoisonedRegression(Regression):
    """``Regression`` with one item whose target is 1e4 times too large: the batch that holds
    it blows the loss up."""

    def __init__(self, n: int = 320, poisoned: int = 100) -> None:
        super().__init__(n)
        self.y[poisoned] *= 1e4


def rollback_trainer(output_dir, poisoned=100, **overrides):
    # 20 steps an epoch: the poisoned item comes once in each
    values = {**SMALL_RUN, "max_steps": 24, "save_strategy": "steps", "save_steps": 2}
    values.update(overrides)
    detector = DivergenceDetector([LossSpike(warmup=3)], action="rollback", skip_past=1)
    torch.manual_seed(0)
    trainer = Trainer(
        LinearModel,
        make_args(output_dir, **values),
        PoisonedRegression(poisoned=poisoned),
        callbacks=[detector],
    )
    return trainer, detector


def test_a_rollback_restores_an_earlier_checkpoint_drops_the_window_and_trains_on(tmp_path):
    trainer, detector = rollback_trainer(tmp_path / "a")
    trainer.train()
    assert detector.diverged is None and trainer.state.global_step == 24
    assert detector.rollbacks, "the poisoned batch was never caught"
    entry = detector.rollbacks[0]
    assert entry["to_step"] < entry["from_step"]
    assert entry["to_checkpoint"] == f"checkpoint-{entry['to_step']:06d}"
    # from the anchor to one step past the spike, up to the end of the epoch
    assert 0 < entry["skipped"]["batches"] <= entry["from_step"] - entry["to_step"] + 1
    assert entry["reason"].startswith("LossSpike: ")
    # deterministic: the same config gives the same rollback and the same weights, bitwise
    again, again_detector = rollback_trainer(tmp_path / "b")
    again.train()
    assert again_detector.rollbacks == detector.rollbacks
    assert_same_tensors(trainer.model.state_dict(), again.model.state_dict())
    # resumed before the spike, a run rolls back alike; resumed after, it keeps the rollback
    # and its position past the dropped batches: the same weights either way
    for step in (entry["to_step"], entry["from_step"] + 2 - entry["from_step"] % 2):
        resumed, resumed_detector = rollback_trainer(tmp_path / "a")
        resumed.train(resume_from_checkpoint=str(checkpoint_dir(tmp_path / "a", step)))
        assert resumed_detector.rollbacks == detector.rollbacks, step
        assert_same_tensors(trainer.model.state_dict(), resumed.model.state_dict())


def test_rollback_stops_the_run_when_no_checkpoint_is_early_enough(tmp_path):
    trainer, detector = rollback_trainer(tmp_path, save_steps=50)  # no checkpoint before it
    trainer.train()
    assert detector.rollbacks == []
    assert "no checkpoint at or before step" in detector.diverged["message"]


class Subset(Dataset):
    """The items of ``dataset`` at ``indices``, in that order."""

    def __init__(self, dataset: Dataset, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.dataset[self.indices[index]]


class LogKeeper(TrainerCallback):
    """The training losses logged, in order (a rolled-back run logs its restored steps again)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs, **kwargs):
        if "loss" in logs and not is_train_summary(logs):
            self.losses.append(logs["loss"])


def test_a_rolled_back_run_ends_as_a_run_that_never_saw_the_dropped_batches(tmp_path):
    # in order, 16 items a step: the poisoned item 100 is in step 7's batch
    run = dict(train_sampling_strategy="sequential", max_steps=16)
    trainer, detector = rollback_trainer(tmp_path / "rolled", **run)
    rolled_logs = LogKeeper()
    trainer.add_callback(rolled_logs)
    trainer.train()
    (entry,) = detector.rollbacks
    assert (entry["from_step"], entry["to_step"]) == (7, 6)
    skipped = entry["skipped"]
    assert (skipped["first_batch"], skipped["batches"]) == (6, 2)  # steps 7 and 8: items 96-127
    # the same data without those items, in the same order, from the start: the same weights
    kept = [i for i in range(320) if not 96 <= i < 128]
    values = {**SMALL_RUN, **run}  # the rolled run's optimizer (plain SGD), as rollback_trainer
    torch.manual_seed(0)
    clean = Trainer(
        LinearModel,
        make_args(tmp_path / "clean", **values),
        Subset(PoisonedRegression(), kept),
        callbacks=[clean_logs := LogKeeper()],
    )
    clean.train()
    assert_same_tensors(trainer.model.state_dict(), clean.model.state_dict())
    # the steps after the rollback logged the clean run's losses, the final one included
    assert rolled_logs.losses[-10:] == clean_logs.losses[-10:]
    assert math.isfinite(rolled_logs.losses[-1])


def test_a_window_past_the_epoch_end_is_cut_there_and_said(tmp_path, caplog):
    # in order, 20 steps an epoch; the poisoned item 300 is in step 19's batch: from the anchor
    # (step 18) to two steps past the spike is three batches, of which the epoch has two
    trainer, detector = rollback_trainer(
        tmp_path, poisoned=300, train_sampling_strategy="sequential", max_steps=22
    )
    detector.skip_past = 2
    with caplog.at_level(logging.WARNING, logger="forge.train.rollback"):
        trainer.train()
    (entry,) = detector.rollbacks
    assert (entry["from_step"], entry["to_step"]) == (19, 18)
    assert entry["skipped"] == {"epoch": 0, "first_batch": 18, "batches": 2, "not_dropped": 1}
    assert "ran past the end of epoch 0" in caplog.text
    assert trainer.state.global_step == 22
