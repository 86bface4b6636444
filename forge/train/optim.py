"""Seeding, and the default optimizer and learning-rate schedule built from TrainingArguments."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from forge.train.args import TrainingArguments
from forge.train.args.names import METRIC_SCHEDULERS

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer, int], LRScheduler]


def set_seed(seed: int) -> None:
    """Seed Python, numpy and torch (every device) so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def default_optimizer(model: nn.Module, args: TrainingArguments) -> Optimizer:
    """The optimizer ``args.optim`` names, built from ``args`` as HF's Trainer builds it;
    biases and norm weights (tensors under 2-d) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer_class, kwargs = optimizer_class_and_kwargs(args, params)
    return optimizer_class([g for g in groups if g["params"]], **kwargs)


def optimizer_class_and_kwargs(
    args: TrainingArguments, params: list[nn.Parameter]
) -> tuple[type[Optimizer], dict[str, Any]]:
    """The torch optimizer class for ``args.optim`` and its keywords (``optim_args`` parsed)."""
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        if args.optim == "adamw_torch_fused":
            # the fused kernel needs floating tensors on CPU or CUDA; elsewhere the for-each one
            fusable = all(
                p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
            )
            if fusable:
                kwargs["fused"] = True
            else:
                logger.info("optim adamw_torch_fused: parameters it cannot fuse; using adamw_torch")
        return torch.optim.AdamW, kwargs
    if args.optim == "adafactor":
        from transformers.optimization import Adafactor

        kwargs.update(scale_parameter=False, relative_step=False)  # as HF: lr from the schedule
        return Adafactor, kwargs
    classes = {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rmsprop": torch.optim.RMSprop,
    }
    if args.optim not in classes:
        raise ValueError(f"{args.config_key}.optim {args.optim!r} is not an optimizer forge builds")
    kwargs.update(args.parsed_optim_args())
    return classes[args.optim], kwargs


def build_optimizer(
    spec: OptimizerFactory | Optimizer | None, model: nn.Module, args: TrainingArguments
) -> Optimizer:
    """None: ``args.optim`` from ``args``; a callable gets the trainable parameters; an
    instance is kept."""
    if spec is None:
        return default_optimizer(model, args)
    if isinstance(spec, Optimizer):
        return spec
    if not callable(spec):
        raise TypeError(
            f"trainer.optimizer must be a callable taking the parameters, e.g. "
            f"!partial:torch.optim:AdamW (got {type(spec).__name__})"
        )
    return spec([p for p in model.parameters() if p.requires_grad])


def num_warmup_steps(args: TrainingArguments, num_training_steps: int) -> int:
    """``warmup_steps`` (a fraction of the training steps when below 1), else
    ``warmup_ratio`` of the training steps, rounded up."""
    return args.warmup_steps_for(num_training_steps)


def build_scheduler(
    spec: SchedulerFactory | LRScheduler | None,
    optimizer: Optimizer,
    args: TrainingArguments,
    num_training_steps: int,
) -> LRScheduler:
    """None: ``transformers.get_scheduler`` from ``args`` (``lr_scheduler_kwargs`` included);
    a callable gets ``(optimizer, num_training_steps)``; an instance is kept.

    Schedules that step on the evaluation metric (``reduce_lr_on_plateau``, ``greedy``) come
    wrapped in :class:`MetricSchedule`, which the loop's per-step ``step()`` leaves alone.
    """
    if spec is None:
        from transformers import get_scheduler

        kwargs = dict(args.lr_scheduler_kwargs or {})
        if args.lr_scheduler_type == "reduce_lr_on_plateau" and "mode" not in kwargs:
            kwargs["mode"] = "max" if args.greater_is_better else "min"  # follow the metric
        scheduler = get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=num_warmup_steps(args, num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=kwargs,
        )
        if args.lr_scheduler_type in METRIC_SCHEDULERS:
            return MetricSchedule(scheduler)  # type: ignore[return-value]
        return scheduler
    if isinstance(spec, LRScheduler):
        return spec
    if not callable(spec):
        raise TypeError(
            "trainer.lr_scheduler must be a callable taking (optimizer, num_training_steps) "
            f"(got {type(spec).__name__})"
        )
    return spec(optimizer, num_training_steps)


class MetricSchedule:
    """A schedule stepped with the evaluation metric (``step(value)`` after each evaluation);
    ``step()`` without a value, which the loop calls every optimizer step, does nothing."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, metric: float | None = None) -> None:
        if metric is not None:
            self.scheduler.step(metric)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def current_lr(scheduler: LRScheduler) -> float:
    """The learning rate of the first parameter group for the next step."""
    lr: Any = scheduler.get_last_lr()[0]
    return float(lr)
