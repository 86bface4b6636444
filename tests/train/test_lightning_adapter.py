"""LightningAdapter without Lightning: a stand-in module with a LightningModule's methods
(tests/train/lightning_common.py) trained by forge's Trainer.

``training_step`` / ``validation_step`` run as written, with the index of the batch in its epoch
(or evaluation); ``configure_optimizers`` gives the optimizer and a schedule that steps as
Lightning's Trainer steps it (``interval``, ``frequency``); ``self.log`` values are logged with
Lightning's ``on_step`` / ``on_epoch`` meanings; a resume is bit for bit, the epoch's means
included; what the adapter does not run is refused with what to do. tests/train/
test_lightning_equivalence.py compares it with Lightning's own Trainer.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from forge.train import LightningAdapter
from forge.train.lightning import LightningAdapterError
from forge.train.model_parts import TrainingPlan
from tests.train.common import StopAtStep, assert_same_tensors, checkpoint_dir, make_args
from tests.train.lightning_common import Blobs, StandIn, adapter_trainer, logged

TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "peak_rss_mb")


def steps_of(records, key):
    return {r["step"]: r[key] for r in records if key in r}


def test_the_steps_run_as_written_with_their_batch_index_and_logs(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="forge.train.setup"):
        trainer = adapter_trainer(tmp_path)
        trainer.train()
    module = trainer.model.module
    assert isinstance(trainer.optimizer, torch.optim.SGD)  # configure_optimizers'
    assert "optimizer and learning-rate schedule from StandIn.configure_optimizers" in caplog.text
    # 5 batches an epoch; current_epoch and batch_idx as Lightning gives them
    assert module.seen == [(e, i) for e in range(3) for i in range(5)][:12]
    records = logged(tmp_path)
    losses = steps_of(records, "loss")
    assert steps_of(records, "train_loss_step") == losses  # on_step: the step's value
    assert steps_of(records, "batch_index") == {s: float((s - 1) % 5) for s in range(1, 13)}
    # on_epoch: the epoch's mean, logged at its last step (none for the epoch cut short)
    epochs = steps_of(records, "train_loss_epoch")
    assert sorted(epochs) == [5, 10]
    for end, first in ((5, 1), (10, 6)):
        mean = sum(losses[s] for s in range(first, end + 1)) / (end - first + 1)
        assert epochs[end] == pytest.approx(mean, abs=1e-7)
    # validation_step's self.log: eval_NAME; it returns no loss, so there is no eval_loss
    accuracy = steps_of(records, "eval_val_acc")
    assert sorted(accuracy) == [5, 10, 12] and all(0 <= a <= 1 for a in accuracy.values())
    assert not any("eval_loss" in r for r in records)
    # StepLR(step_size=3) stepped after every optimizer step: the next step's rate halves
    rates = steps_of(records, "learning_rate")
    assert rates == {s: 0.1 * 0.5 ** (s // 3) for s in range(1, 13)}


@pytest.mark.parametrize(
    ("interval", "frequency", "accumulation", "halved_after"),
    [
        # a step schedule steps when the epoch's micro-batches so far are a multiple of its
        # frequency: after batches 2 and 4 of each 5-batch epoch, not across the boundary
        ("step", 2, 1, [2, 4, 7, 9, 12]),
        # with 2 micro-batches a step (windows 2, 2, 1): after batches 2 and 4 again
        ("step", 2, 2, [1, 2, 4, 5, 7, 8, 10, 11]),
        # an epoch schedule with frequency 2: after every second epoch
        ("epoch", 2, 1, [10, 20]),
        ("epoch", 1, 2, [3, 6, 9, 12]),
    ],
)
def test_a_schedule_steps_as_lightnings_trainer_steps_it(
    interval, frequency, accumulation, halved_after, tmp_path
):
    module = functools.partial(StandIn, interval, frequency, step_size=1)
    max_steps = 22 if interval == "epoch" and accumulation == 1 else 12
    trainer = adapter_trainer(
        tmp_path, module, max_steps=max_steps, gradient_accumulation_steps=accumulation
    )
    trainer.train()
    rates = steps_of(logged(tmp_path), "learning_rate")
    expected, rate = {}, 0.1
    for step in range(1, max_steps + 1):
        rate *= 0.5 if step in halved_after else 1.0
        expected[step] = rate
    assert rates == pytest.approx(expected)


def _compare_runs(straight, resumed):
    assert_same_tensors(straight.model.state_dict(), resumed.model.state_dict(), "model")
    assert_same_tensors(
        straight.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer"
    )
    assert_same_tensors(
        straight.lr_scheduler.state_dict(), resumed.lr_scheduler.state_dict(), "lr_scheduler"
    )
    assert_same_tensors(
        straight.model.progress.state_dict(), resumed.model.progress.state_dict(), "progress"
    )


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_resume_through_the_adapter_is_bit_for_bit(accumulation, tmp_path):
    """Stopped inside the second epoch (its on_epoch sums half made, an epoch schedule), saved
    and resumed: the weights, optimizer, schedule, the epoch's progress and everything logged
    after the resume are those of the straight run."""
    module = functools.partial(StandIn, "epoch", 1, step_size=1)
    settings = dict(
        max_steps=9, save_strategy="steps", save_steps=4, gradient_accumulation_steps=accumulation
    )
    straight = adapter_trainer(tmp_path / "straight", module, **settings)
    straight.train()
    stop = adapter_trainer(tmp_path / "run", module, callbacks=(StopAtStep(4),), **settings)
    stop.train()
    resumed = adapter_trainer(tmp_path / "run", module, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.resumed_from and resumed.state.global_step == 9
    _compare_runs(straight, resumed)
    after = [
        {k: v for k, v in r.items() if k not in TIMING and not k.endswith(("_runtime", "_second"))}
        for r in logged(tmp_path / "run")
        if r["step"] > 4 and "train_loss" not in r
    ]
    expected = [
        {k: v for k, v in r.items() if k not in TIMING and not k.endswith(("_runtime", "_second"))}
        for r in logged(tmp_path / "straight")
        if r["step"] > 4 and "train_loss" not in r
    ]
    assert after == expected
    assert any("train_loss_epoch" in r for r in after)  # an epoch mean across the resume
    saved = checkpoint_dir(tmp_path / "run", 4)
    assert (saved / "lightning-rank-00000.pt").exists()


def test_the_checkpoint_holds_the_modules_own_weights(tmp_path):
    trainer = adapter_trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    trainer.train()
    weights = load_file(checkpoint_dir(tmp_path, 4) / "model.safetensors")
    module = StandIn()
    module.load_state_dict(weights)  # strict: the plain module's names
    assert_same_tensors(dict(module.state_dict()), dict(trainer.model.module.state_dict()))


class DictBatches(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        return {"features": torch.full((4,), float(index)), "target": torch.tensor(index % 3)}


class DictStep(StandIn):
    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch["features"]), batch["target"])


def test_every_column_reaches_the_step(tmp_path):
    """The step takes the batch whole: remove_unused_columns (on) drops nothing that forward's
    signature (``x``) does not name."""
    args = make_args(tmp_path, max_steps=2, per_device_train_batch_size=4)
    assert args.remove_unused_columns
    from forge.train import Trainer

    trainer = Trainer(functools.partial(LightningAdapter, DictStep), args, DictBatches())
    assert trainer.train().global_step == 2


# ---------------------------------------------------------------------- what is refused
@pytest.mark.parametrize(
    ("hook", "fix"),
    [
        ("on_train_epoch_end", "log with self.log in training_step"),
        ("on_validation_epoch_end", "on_epoch=True gives the epoch's mean"),
        ("on_after_backward", "the trainer runs the backward and the optimizer step itself"),
        ("optimizer_step", "the trainer runs the backward and the optimizer step itself"),
        ("configure_gradient_clipping", "set trainer_args.max_grad_norm"),
        ("transfer_batch_to_device", "build the batch in the config's data_collator"),
        ("train_dataloader", "give the data in the config's datasets block"),
        ("setup", "build the layers in __init__"),
        ("on_save_checkpoint", "a forge checkpoint holds the weights and buffers"),
        ("configure_callbacks", "give forge TrainerCallbacks in the config's callbacks block"),
    ],
)
def test_a_hook_the_adapter_does_not_run_is_refused_with_what_to_do(hook, fix):
    module = type("WithHook", (StandIn,), {hook: lambda self, *a, **k: None})()
    with pytest.raises(LightningAdapterError) as error:
        LightningAdapter(module)
    message = str(error.value)
    assert f"LightningAdapter does not run {hook}, which WithHook overrides" in message
    assert f"WithHook.{hook}: " in message and fix in message
    assert f"list them in the adapter's ignore_hooks: [{hook}]" in message


def test_an_ignored_hook_is_warned_of_once_and_the_module_trains(tmp_path, caplog):
    class Epochs(StandIn):
        def on_train_epoch_end(self):
            raise AssertionError("not run")

    def build():
        return LightningAdapter(Epochs(), batch_type="list", ignore_hooks=["on_train_epoch_end"])

    with caplog.at_level(logging.WARNING):
        build()
        build()
    warnings = [r for r in caplog.records if "does not run Epochs.on_train_epoch_end" in r.message]
    assert len(warnings) == 1 and "ignore_hooks lists it" in warnings[0].message
    trainer = adapter_trainer(tmp_path, max_steps=6)
    trainer.model_init = build
    assert trainer.train().global_step == 6
    with pytest.raises(LightningAdapterError, match="ignore_hooks names on_fit_start, which"):
        LightningAdapter(StandIn(), ignore_hooks=["on_fit_start"])


def test_manual_optimization_and_a_module_without_training_step_are_refused():
    manual = StandIn()
    manual.automatic_optimization = False
    with pytest.raises(LightningAdapterError, match="automatic_optimization is False"):
        LightningAdapter(manual)
    with pytest.raises(LightningAdapterError, match="has no training_step"):
        LightningAdapter(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="batch_type must be one of dict, list"):
        LightningAdapter(StandIn(), batch_type="tuple")


class NoLoss(StandIn):
    def training_step(self, batch, batch_idx):
        return None


class Reads(StandIn):
    def training_step(self, batch, batch_idx):
        return self.trainer.fit_loop


class AsksOptimizers(StandIn):
    def training_step(self, batch, batch_idx):
        return self.trainer.strategy._lightning_optimizers  # LightningModule.optimizers()


class AsksSchedulers(StandIn):
    def training_step(self, batch, batch_idx):
        return self.trainer.lr_scheduler_configs  # LightningModule.lr_schedulers()


class LogsMax(StandIn):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("peak", loss, reduce_fx="max")
        return loss


class LogsAList(StandIn):
    def training_step(self, batch, batch_idx):
        self.log("parts", [1.0, 2.0])
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (NoLoss, "NoLoss.training_step returned None; Lightning skips such a batch"),
        (Reads, "Reads reads self.trainer.fit_loop, which forge's LightningAdapter does not give"),
        (AsksOptimizers, "AsksOptimizers calls self.optimizers(), which forge's"),
        (AsksSchedulers, "AsksSchedulers calls self.lr_schedulers(), which forge's"),
        (LogsMax, "self.log('peak', ...) with reduce_fx='max': forge averages logged values"),
        (LogsAList, "self.log('parts', ...) with a list: forge logs numbers"),
    ],
)
def test_what_a_step_asks_that_forge_does_not_do_stops_the_run_saying_so(module, message, tmp_path):
    with pytest.raises(
        LightningAdapterError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        adapter_trainer(tmp_path, module, max_steps=2).train()


def test_a_module_without_validation_step_cannot_be_evaluated():
    class TrainOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.body(x), y)

    adapter = LightningAdapter(TrainOnly(), batch_type="list")
    adapter.eval()
    x, y = Blobs(4)[0]
    with pytest.raises(LightningAdapterError, match="TrainOnly has no validation_step, which"):
        adapter(x=x[None], y=y[None])


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda p: None, "returned None (Lightning would train without an optimizer)"),
        (
            lambda p: [torch.optim.SGD(p, lr=0.1), torch.optim.SGD(p, lr=0.1)],
            "returned 2 optimizers; Lightning runs several only with manual optimization",
        ),
        (
            lambda p: (
                lambda o: {
                    "optimizer": o,
                    "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o),
                    "monitor": "val_loss",
                }
            )(torch.optim.SGD(p, lr=0.1)),
            "returned a ReduceLROnPlateau scheduler (monitor: 'val_loss'), which steps on a metric",
        ),
        (
            lambda p: (
                lambda o: {
                    "optimizer": o,
                    "lr_scheduler": {
                        "scheduler": torch.optim.lr_scheduler.StepLR(o, 1),
                        "intervall": "step",
                    },
                }
            )(torch.optim.SGD(p, lr=0.1)),
            "returned a scheduler dict with keys Lightning does not read: intervall",
        ),
        (
            lambda p: (
                lambda o: (
                    [o],
                    [{"scheduler": torch.optim.lr_scheduler.StepLR(o, 1), "interval": "batch"}],
                )
            )(torch.optim.SGD(p, lr=0.1)),
            "a scheduler's interval must be 'step' or 'epoch' (got 'batch')",
        ),
    ],
)
def test_what_configure_optimizers_returns_is_read_as_lightning_reads_it_or_refused(
    returned, message, tmp_path
):
    class Configured(StandIn):
        def configure_optimizers(self):
            return returned(list(self.parameters()))

    from forge.train.sanity import SanityFailure, run_sanity_pass

    pattern = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(LightningAdapterError, match=pattern):
        adapter_trainer(tmp_path, Configured, max_steps=2).train()
    # the sanity pass (forge train's dry run) finds it before a run directory exists
    with pytest.raises(SanityFailure, match=pattern) as found:
        run_sanity_pass(adapter_trainer(tmp_path / "dry", Configured, max_steps=2), 0)
    assert found.value.part == "model" and "building the optimizer" in found.value.doing


def test_the_forms_configure_optimizers_may_take(tmp_path):
    """A bare optimizer (the rate stays), ([optimizer], [scheduler]) with a bare scheduler
    (Lightning's default: interval epoch)."""

    class Bare(StandIn):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Lists(StandIn):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)]

    adapter_trainer(tmp_path / "bare", Bare, max_steps=6).train()
    assert set(steps_of(logged(tmp_path / "bare"), "learning_rate").values()) == {0.1}
    adapter_trainer(tmp_path / "lists", Lists, max_steps=6).train()
    rates = steps_of(logged(tmp_path / "lists"), "learning_rate")
    assert rates == {s: 0.1 if s < 5 else 0.05 for s in range(1, 7)}  # after the epoch


def test_the_trainers_own_optimizer_wins_with_a_warning(tmp_path, caplog):
    trainer = adapter_trainer(tmp_path, max_steps=2)
    trainer.optimizer_factory = functools.partial(torch.optim.Adam, lr=1e-3)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert isinstance(trainer.optimizer, torch.optim.Adam)
    assert (
        "the trainer's optimizer / lr_scheduler are given, so those of "
        "StandIn.configure_optimizers are not used" in caplog.text
    )


def test_logged_names_the_trainer_reads_itself_are_warned_of(tmp_path, caplog):
    class LogsLoss(StandIn):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss)
            return loss

    with caplog.at_level(logging.WARNING):
        adapter_trainer(tmp_path, LogsLoss, max_steps=3).train()
    assert caplog.text.count("self.log('loss', ...) in training_step is not logged") == 1


def test_self_log_outside_the_steps_is_refused():
    class LogsInConfigure(StandIn):
        def configure_optimizers(self):
            self.log("lr", 0.1)

    adapter = LightningAdapter(LogsInConfigure())
    with pytest.raises(LightningAdapterError, match="outside training_step and validation_step"):
        adapter.module.configure_optimizers()


def test_the_pipeline_trainer_is_refused():
    topology = SimpleNamespace(num_stages=2)
    plan = TrainingPlan(10, 1, 5, 1, topology)
    with pytest.raises(LightningAdapterError, match="the pipeline trainer splits a model's"):
        LightningAdapter(StandIn()).trainer_parts(plan)


def test_the_accelerate_trainer_trains_the_adapter_as_the_plain_one(tmp_path):
    from forge.train import AccelTrainer

    plain = adapter_trainer(tmp_path / "plain", max_steps=7)
    plain.train()
    accelerated = adapter_trainer(tmp_path / "accel", max_steps=7)
    accelerated = AccelTrainer(
        accelerated.model_init,
        accelerated.args,
        accelerated.train_dataset,
        eval_dataset=accelerated.eval_dataset,
        data_collator=accelerated.data_collator,
    )
    accelerated.train()
    keys = ("loss", "train_loss_epoch", "learning_rate", "eval_val_acc")

    def numbers(path):
        return [{k: r[k] for k in keys if k in r} for r in logged(path)]

    assert numbers(tmp_path / "accel") == numbers(tmp_path / "plain")
    assert_same_tensors(plain.model.state_dict(), accelerated.model.state_dict())
