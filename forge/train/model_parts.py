"""What a model may bring to the trainer that trains it: its own optimizer and learning-rate
schedule, and callbacks (which add checkpoint state through ``on_register``).

A model that is more than a forward offers its parts through one method, ``trainer_parts(plan)``
returning :class:`ModelParts`, which ``train()`` calls once the model is built and the run's
length is known, before the optimizer exists. ``forge.train.LightningAdapter`` is such a model:
a LightningModule's ``configure_optimizers`` gives the optimizer and schedule, and a callback
keeps the epoch bookkeeping its ``self.log`` needs. The trainer's own ``optimizer`` /
``lr_scheduler`` arguments win over what a model offers (a warning names what is then not
used): the two are used as a pair, since a schedule is built on its optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from forge.train.topology import Topology
from forge.wrappers import class_label

__all__ = ["ModelParts", "TrainingPlan", "offered_parts"]


@dataclass(frozen=True)
class TrainingPlan:
    """What a model is told of the run before its first step."""

    max_steps: int
    num_epochs: int
    batches_per_epoch: int  # this rank's micro-batches in one epoch
    gradient_accumulation_steps: int
    topology: Topology


@dataclass
class ModelParts:
    """Trainer parts a model offers; None where it offers none (the trainer's defaults).

    ``optimizer`` is called as the trainer's ``optimizer`` argument is (with the trainable
    parameters), ``lr_scheduler`` as its ``lr_scheduler`` (``(optimizer, num_training_steps)``).
    ``source`` names them in messages (``Classifier.configure_optimizers``).
    """

    optimizer: Callable[[list[nn.Parameter]], Any] | None = None
    lr_scheduler: Callable[[Any, int], Any] | None = None
    callbacks: list[Any] = field(default_factory=list)
    source: str = "the model"


def offered_parts(model: nn.Module, plan: TrainingPlan) -> ModelParts:
    """The parts ``model`` offers (``model.trainer_parts(plan)``), or none."""
    offer = getattr(model, "trainer_parts", None)
    if not callable(offer):
        return ModelParts()
    parts = offer(plan)
    if not isinstance(parts, ModelParts):
        raise TypeError(
            f"{class_label(model)}.trainer_parts must return forge.train.model_parts."
            f"ModelParts (got {type(parts).__name__})"
        )
    return parts
