"""Trainers: the shared loop (loop.py) composed with a parallelism strategy (strategies/) into
the plain / DDP / FSDP, Accelerate and pipeline-parallel trainers (trainers.py), their
arguments (args/) and callbacks.

Names are imported lazily, so ``forge.train.topology`` (used by the CLI) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AccelTrainer": "trainers",
    "AccelTrainingArguments": "args.accelerate",
    "LightningAdapter": "lightning",
    "LossAdapter": "plain_models",
    "TrainingArguments": "args",
    "TrainingArgumentsError": "args",
    "BaseTrainer": "loop",
    "StepResult": "loop_state",
    "TrainOutput": "loop_state",
    "EMACallback": "ema",
    "DivergenceDetector": "divergence",
    "GradNormSpike": "divergence",
    "LossSpike": "divergence",
    "MetricRise": "divergence",
    "NonFiniteStreak": "divergence",
    "SustainedRise": "divergence",
    "EarlyStoppingCallback": "callbacks",
    "JsonlMetricsCallback": "callbacks",
    "ProgressCallback": "callbacks",
    "TensorBoardCallback": "callbacks",
    "TrainerCallback": "callbacks",
    "TrainerControl": "callbacks",
    "TrainerState": "callbacks",
    "set_seed": "optim",
    "PipelineTrainer": "trainers",
    "PipelineTrainingArguments": "args.pipeline",
    "TrainingInterrupted": "signals",
    "Topology": "topology",
    "Trainer": "trainers",
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
