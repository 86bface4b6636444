"""Trainers: the shared loop, the plain / DDP trainer, their arguments and callbacks."""

from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.base import BaseTrainer, StepResult, TrainOutput
from forge.train.callbacks import (
    EarlyStoppingCallback,
    JsonlMetricsCallback,
    ProgressCallback,
    TensorBoardCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from forge.train.optim import set_seed
from forge.train.signals import TrainingInterrupted
from forge.train.trainer import Trainer

__all__ = [
    "BaseTrainer",
    "EarlyStoppingCallback",
    "JsonlMetricsCallback",
    "ProgressCallback",
    "StepResult",
    "TensorBoardCallback",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "TrainingArgumentsError",
    "TrainingInterrupted",
    "set_seed",
]
