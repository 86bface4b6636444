"""Small records the loop keeps: one step's agreed numbers, the data position, log tallies."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

Batch = dict[str, Any]


class TrainOutput(NamedTuple):
    """What ``train()`` returns: the final step, the mean training loss of this call, metrics."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


@dataclass
class StepResult:
    """One optimizer step's numbers, identical on every rank."""

    loss: float  # mean micro-batch loss, averaged over ranks
    tokens: int  # tokens of the step, summed over ranks
    grad_norm: float
    finite: bool  # False: the step must be skipped (when skip_nonfinite)


@dataclass
class Position:
    """Where the loop is in the data: the epoch and the micro-batches this rank has taken."""

    epoch: int = 0
    batch: int = 0


class Tally:
    """Sums step results between two logs (and over a whole ``train()`` call)."""

    def __init__(self) -> None:
        self.steps = self.finite_steps = self.skipped = self.tokens = 0
        self.loss_sum = 0.0
        self.grad_norm = float("nan")
        self.started = time.perf_counter()

    def add(self, step: StepResult) -> None:
        self.steps += 1
        self.tokens += step.tokens
        self.grad_norm = step.grad_norm
        if step.finite and math.isfinite(step.loss):
            self.finite_steps += 1
            self.loss_sum += step.loss
        if not step.finite:
            self.skipped += 1

    def state_dict(self) -> dict[str, Any]:
        """The loss part (not tokens or time), so a resumed run logs the same mean losses."""
        keys = ("steps", "finite_steps", "skipped", "loss_sum", "grad_norm")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.finite_steps if self.finite_steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)


def count_tokens(batch: Batch) -> torch.Tensor:
    """Tokens in a batch: the attention mask's ones, else the number of input ids."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.sum()
    ids = batch.get("input_ids")
    return torch.tensor(ids.numel() if isinstance(ids, torch.Tensor) else 0)
