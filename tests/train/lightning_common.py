"""Shared pieces of the LightningAdapter tests: a tuple dataset, a stand-in module with a
LightningModule's methods on a plain ``nn.Module`` (the adapter tested without Lightning),
and the trainer those tests build."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from forge.data import TupleCollator
from forge.train import LightningAdapter, Trainer
from tests.train.common import make_args

#: how a test that needs Lightning says what to install
NEEDS_LIGHTNING = (
    "needs Lightning: .venv/bin/pip install 'lightning>=2.4' 'torch==<the installed version>' "
    "(or pip install -e '.[lightning]')"
)


class Blobs(Dataset):
    """``n`` items ``(x, y)``: 4 features around the class mean, 3 classes."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(3, (n,), generator=generator)
        self.x = torch.randn(n, 4, generator=generator) + self.y[:, None].float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class StandIn(nn.Module):
    """A LightningModule's steps on a plain ``nn.Module``: the adapter gives it ``self.log``
    and ``self.trainer`` as it gives them to a LightningModule. Its loss is in
    ``training_step``; it logs ``train_loss`` on step and epoch, ``batch_idx`` (to see the
    index it is given) and ``val_acc``; ``configure_optimizers`` returns SGD with a StepLR
    dict (``interval``, ``frequency``)."""

    def __init__(self, interval: str = "step", frequency: int = 1, step_size: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        self.interval, self.frequency, self.step_size = interval, frequency, step_size
        self.seen: list[tuple[int, int]] = []  # (current_epoch, batch_idx) of each training call

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.seen.append((self.trainer.current_epoch, batch_idx))
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("batch_index", float(batch_idx), on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.step_size, gamma=0.5)
        schedule = {"scheduler": scheduler, "interval": self.interval, "frequency": self.frequency}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def adapter_trainer(
    output_dir: Path,
    module: Any = StandIn,
    *,
    train_size: int = 40,
    callbacks: tuple = (),
    **overrides: Any,
) -> Trainer:
    """forge's Trainer over ``module`` (a class or a partial) through LightningAdapter, on
    Blobs in order (5 batches of 8 per epoch), evaluating at each epoch's end, no clipping (as
    Lightning's Trainer without gradient_clip_val), logging every step."""
    values: dict[str, Any] = dict(
        max_steps=12,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        logging_steps=1,
        eval_strategy="epoch",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        seed=0,
    )
    values.update(overrides)
    model = functools.partial(LightningAdapter, module, batch_type="list")
    return Trainer(
        model,
        make_args(output_dir, **values),
        Blobs(train_size),
        eval_dataset=Blobs(20, seed=1),
        data_collator=TupleCollator(["x", "y"]),
        callbacks=list(callbacks),
    )


def logged(output_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
