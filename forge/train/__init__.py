"""Trainers: the shared loop, the plain / DDP, Accelerate and pipeline-parallel trainers, their
arguments and callbacks.

Names are imported lazily, so ``forge.train.topology`` (used by the CLI) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AccelTrainer": "accel",
    "AccelTrainingArguments": "accel",
    "LossAdapter": "adapters",
    "TrainingArguments": "args",
    "TrainingArgumentsError": "args",
    "BaseTrainer": "base",
    "StepResult": "base",
    "TrainOutput": "base",
    "EarlyStoppingCallback": "callbacks",
    "JsonlMetricsCallback": "callbacks",
    "ProgressCallback": "callbacks",
    "TensorBoardCallback": "callbacks",
    "TrainerCallback": "callbacks",
    "TrainerControl": "callbacks",
    "TrainerState": "callbacks",
    "set_seed": "optim",
    "PipelineTrainer": "pipeline",
    "PipelineTrainingArguments": "pipeline",
    "TrainingInterrupted": "signals",
    "Topology": "topology",
    "Trainer": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'forge.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"forge.train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
