"""Training arguments: the flat, validated settings every forge trainer reads, with Hugging
Face's names and defaults. Nothing here imports torch, so a config's arguments are checked
before anything is built.

- ``training``: ``TrainingArguments`` (every HF field, ``validate()``), ``TrainingArgumentsError``;
- ``names``: HF's value names (schedules, optimizers, integrations) and what forge does with each;
- ``values``: how one value is checked and normalised;
- ``step_checks`` / ``run_checks``: the checks, by area;
- ``fsdp``: HF's ``fsdp`` / ``fsdp_config`` read for FSDP2;
- ``accelerate`` / ``pipeline``: what the Accelerate and pipeline trainers add.
"""

from forge.train.args.names import (
    INTEGRATIONS,
    METRIC_SCHEDULERS,
    NOT_APPLICABLE,
    OPTIMIZERS,
    OTHER_HF_OPTIMIZERS,
    SCHEDULERS,
    SHARDING_UNSUPPORTED,
)
from forge.train.args.training import TrainingArguments, TrainingArgumentsError

__all__ = [
    "INTEGRATIONS",
    "METRIC_SCHEDULERS",
    "NOT_APPLICABLE",
    "OPTIMIZERS",
    "OTHER_HF_OPTIMIZERS",
    "SCHEDULERS",
    "SHARDING_UNSUPPORTED",
    "TrainingArguments",
    "TrainingArgumentsError",
]
