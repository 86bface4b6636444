"""Seeding, and the default optimizer and learning-rate schedule built from TrainingArguments."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from forge.train.args import TrainingArguments

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer, int], LRScheduler]


def set_seed(seed: int) -> None:
    """Seed Python, numpy and torch (every device) so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def default_optimizer(model: nn.Module, args: TrainingArguments) -> Optimizer:
    """AdamW from ``args``; biases and norm weights (tensors under 2-d) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel (HF Trainer's default on recent torch) is 2-3x faster per step than
    # the for-loop one, and as deterministic; it needs floating tensors on CPU or CUDA.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused or None,
    )


def build_optimizer(
    spec: OptimizerFactory | Optimizer | None, model: nn.Module, args: TrainingArguments
) -> Optimizer:
    """None: AdamW from ``args``; a callable gets the trainable parameters; an instance is kept."""
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
    """``warmup_steps`` when set, else ``warmup_ratio`` of the training steps, rounded up."""
    if args.warmup_steps > 0:
        return args.warmup_steps
    return math.ceil(args.warmup_ratio * num_training_steps)


def build_scheduler(
    spec: SchedulerFactory | LRScheduler | None,
    optimizer: Optimizer,
    args: TrainingArguments,
    num_training_steps: int,
) -> LRScheduler:
    """None: ``transformers.get_scheduler`` from ``args``; a callable gets
    ``(optimizer, num_training_steps)``; an instance is kept."""
    if spec is None:
        from transformers import get_scheduler

        return get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=num_warmup_steps(args, num_training_steps),
            num_training_steps=num_training_steps,
        )
    if isinstance(spec, LRScheduler):
        return spec
    if not callable(spec):
        raise TypeError(
            "trainer.lr_scheduler must be a callable taking (optimizer, num_training_steps) "
            f"(got {type(spec).__name__})"
        )
    return spec(optimizer, num_training_steps)


def current_lr(scheduler: LRScheduler) -> float:
    """The learning rate of the first parameter group for the next step."""
    lr: Any = scheduler.get_last_lr()[0]
    return float(lr)
