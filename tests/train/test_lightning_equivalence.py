"""A LightningModule trained by Lightning's own Trainer and by forge's through LightningAdapter,
for the same steps and data order: the same training losses step by step, learning rates,
weights, and epoch and validation metrics; a resume through the adapter is bit for bit; what
Lightning's base class gives the module (``self.current_epoch``, ``self.trainer``, hooks it
overrides) is what forge gives or refuses.

Observed on CPU (torch 2.13, Lightning 2.6.6): losses, learning rates and weights bit for bit
equal; the epoch means and validation metrics differ by up to 2.4e-8 (Lightning sums them in
float32, forge in float64).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from forge.train import LightningAdapter, set_seed
from forge.train.lightning import LightningAdapterError
from tests.train.common import StopAtStep, assert_same_tensors
from tests.train.lightning_common import NEEDS_LIGHTNING, Blobs, adapter_trainer, logged

L = pytest.importorskip("lightning", reason=NEEDS_LIGHTNING)

MEANS = 1e-6  # epoch and validation means: float32 sums (Lightning) against float64 (forge)


class Classifier(L.LightningModule):
    """Its loss in training_step, logged on step and epoch; validation logs val_acc and
    val_loss; configure_optimizers returns SGD and a StepLR dict (``interval``,
    ``frequency``)."""

    def __init__(self, interval: str = "step", frequency: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        self.interval, self.frequency = interval, frequency

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())
        self.log("val_loss", nn.functional.cross_entropy(logits, y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        step_size = 3 if self.interval == "step" else 1
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)
        schedule = {"scheduler": scheduler, "interval": self.interval, "frequency": self.frequency}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


class Recorder(L.pytorch.loggers.Logger):
    """What Lightning logs, step by step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.rates: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


def train_with_lightning(module_builder, max_steps: int):
    """Lightning's Trainer on CPU, deterministic, no sanity steps, validating each epoch, the
    data in order (the same 5 batches of 8 an epoch as forge's), seeded as forge seeds."""
    set_seed(0)  # forge's train() seeds, then builds the model
    module = module_builder()
    recorder, steps = Recorder(), StepLosses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        num_sanity_val_steps=0,
        deterministic=True,
        logger=recorder,
        callbacks=[steps],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        module,
        DataLoader(Blobs(40), batch_size=8, shuffle=False),
        DataLoader(Blobs(20, seed=1), batch_size=8),
    )
    return module, steps, recorder.rows


@pytest.mark.parametrize(
    ("interval", "frequency", "max_steps"), [("step", 1, 12), ("epoch", 2, 22)]
)
def test_lightning_and_forge_train_a_lightning_module_alike(
    interval, frequency, max_steps, tmp_path
):
    builder = functools.partial(Classifier, interval, frequency)
    module, steps, rows = train_with_lightning(builder, max_steps)
    trainer = adapter_trainer(tmp_path, builder, max_steps=max_steps)
    trainer.train()
    records = logged(tmp_path)
    train_rows = [r for r in records if "loss" in r]
    assert [r["loss"] for r in train_rows] == steps.losses  # bit for bit, step by step
    assert [r["train_loss_step"] for r in train_rows] == steps.losses
    # forge logs the rate of the next step; Lightning's callback saw it after the step too
    assert [r["learning_rate"] for r in train_rows] == steps.rates
    assert_same_tensors(dict(module.state_dict()), dict(trainer.model.module.state_dict()))

    # Lightning logs its steps from 0; forge from 1. Lightning also logs the mean of the epoch
    # that max_steps cuts short; forge only whole epochs'
    epochs = {step + 1: m["train_loss_epoch"] for step, m in rows if "train_loss_epoch" in m}
    assert max(epochs) == max_steps and max_steps % 5
    del epochs[max_steps]
    forge_epochs = {r["step"]: r["train_loss_epoch"] for r in train_rows if "train_loss_epoch" in r}
    assert forge_epochs.keys() == epochs.keys() == set(range(5, max_steps, 5))
    for step, value in epochs.items():
        assert forge_epochs[step] == pytest.approx(value, abs=MEANS)
    validations = {step + 1: m for step, m in rows if "val_acc" in m}
    forge_evals = {r["step"]: r for r in records if "eval_val_acc" in r}
    assert validations, "Lightning validated"
    for step, metrics in validations.items():  # forge also evaluates at the run's end
        assert forge_evals[step]["eval_val_acc"] == pytest.approx(metrics["val_acc"], abs=MEANS)
        assert forge_evals[step]["eval_val_loss"] == pytest.approx(metrics["val_loss"], abs=MEANS)


class DroppingCNN(Classifier):
    """A small convolutional net with dropout: its masks come from the global generator."""

    def __init__(self) -> None:
        super().__init__("step", 1)
        self.body = nn.Sequential(
            nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 4, 3, padding=1), nn.ReLU(), nn.Dropout(0.3),
            nn.Flatten(), nn.Linear(16, 3),
        )  # fmt: skip


def test_a_module_with_dropout_keeps_lightnings_losses_after_its_validations(tmp_path):
    """Each validation starts an iterator over the validation loader, which draws its base
    seed from the global generator, in Lightning's loop as in forge's: the dropout masks after
    the validations at steps 5 and 10 are Lightning's."""
    module, steps, rows = train_with_lightning(DroppingCNN, 13)
    assert sorted(step + 1 for step, m in rows if "val_acc" in m) == [5, 10]
    trainer = adapter_trainer(tmp_path, DroppingCNN, max_steps=13)
    trainer.train()
    assert [r["loss"] for r in logged(tmp_path) if "loss" in r] == steps.losses
    assert_same_tensors(dict(module.state_dict()), dict(trainer.model.module.state_dict()))


def test_a_lightning_module_resumes_bit_for_bit_through_the_adapter(tmp_path):
    builder = functools.partial(Classifier, "epoch", 1)
    settings = dict(max_steps=9, save_strategy="steps", save_steps=4)
    straight = adapter_trainer(tmp_path / "straight", builder, **settings)
    straight.train()
    adapter_trainer(tmp_path / "run", builder, callbacks=(StopAtStep(7),), **settings).train()
    resumed = adapter_trainer(tmp_path / "run", builder, **settings)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.resumed_from and resumed.state.global_step == 9
    assert_same_tensors(straight.model.state_dict(), resumed.model.state_dict(), "model")
    assert_same_tensors(straight.optimizer.state_dict(), resumed.optimizer.state_dict(), "opt")
    assert_same_tensors(straight.lr_scheduler.state_dict(), resumed.lr_scheduler.state_dict())
    assert_same_tensors(straight.model.progress.state_dict(), resumed.model.progress.state_dict())


class Probe(Classifier):
    """Reads what Lightning's base class reads from its trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, int, bool]] = []

    def training_step(self, batch, batch_idx):
        trainer = self.trainer
        self.seen.append((self.current_epoch, self.global_step, batch_idx, trainer.is_global_zero))
        assert self.logger is None and trainer.estimated_stepping_batches == 7
        assert trainer.num_training_batches == 5 and trainer.max_epochs == 2
        return super().training_step(batch, batch_idx)


def test_what_a_lightning_module_reads_of_its_trainer(tmp_path):
    trainer = adapter_trainer(tmp_path, Probe, max_steps=7)
    trainer.train()
    seen = trainer.model.module.seen
    assert seen == [(s // 5, s, s % 5, True) for s in range(7)]


def test_a_lightning_modules_hooks_and_trainer_reads_are_refused_saying_what_to_do(tmp_path):
    class EpochEnd(Classifier):
        def on_validation_epoch_end(self):
            pass

    with pytest.raises(LightningAdapterError) as error:
        LightningAdapter(EpochEnd())
    assert "LightningAdapter does not run on_validation_epoch_end, which EpochEnd overrides" in str(
        error.value
    )
    Classifier()  # Lightning's own defaults of the hooks are no override

    class Manual(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(LightningAdapterError, match="Manual.automatic_optimization is False"):
        LightningAdapter(Manual())

    class Strategy(Classifier):
        def training_step(self, batch, batch_idx):
            return self.trainer.strategy.reduce(super().training_step(batch, batch_idx))

    with pytest.raises(
        LightningAdapterError,
        match=r"Strategy (reads self\.trainer\.strategy|calls self\.optimizers\(\))",
    ):
        adapter_trainer(tmp_path, Strategy, max_steps=1).train()


def test_self_print_prints_on_rank_zero(tmp_path, capsys):
    class Prints(Classifier):
        def training_step(self, batch, batch_idx):
            self.print("step", batch_idx)
            return super().training_step(batch, batch_idx)

    adapter_trainer(tmp_path, Prints, max_steps=2).train()
    assert "step 0\nstep 1\n" in capsys.readouterr().out
