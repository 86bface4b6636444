"""The callbacks a trainer adds from its arguments, before the user's own: on rank 0 the console
progress, ``metrics.jsonl`` and the ``report_to`` integrations; early stopping
(``early_stopping_patience``, unless the user gave one), cache emptying
(``torch_empty_cache_steps``) and a moving average of the weights (``ema_decay``) where asked."""

from __future__ import annotations

from forge.train.args import TrainingArguments
from forge.train.callbacks import (
    EarlyStoppingCallback,
    EmptyCacheCallback,
    JsonlMetricsCallback,
    ProgressCallback,
    TrainerCallback,
)
from forge.train.ema import EMACallback
from forge.train.integrations import integration_callback


def default_callbacks(
    args: TrainingArguments, is_main: bool, user_callbacks: list[TrainerCallback]
) -> list[TrainerCallback]:
    callbacks: list[TrainerCallback] = []
    if is_main:
        callbacks += [ProgressCallback(), JsonlMetricsCallback()]
        callbacks += [integration_callback(name) for name in args.report_to]
    if args.torch_empty_cache_steps:
        callbacks.append(EmptyCacheCallback())
    has_early_stopping = any(isinstance(cb, EarlyStoppingCallback) for cb in user_callbacks)
    if args.early_stopping_patience and not has_early_stopping:
        callbacks.append(EarlyStoppingCallback())
    if args.ema_decay is not None:
        callbacks.append(EMACallback.from_args(args))
    return callbacks
