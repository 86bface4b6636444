"""Predictions, labels and losses over an evaluation: accumulated, gathered in dataset order,
averaged.

Evaluation follows Hugging Face's ``Trainer.evaluation_loop``: each rank runs its share of the
dataset, predictions and labels are padded with -100 and concatenated, moved to host memory
every ``eval_accumulation_steps`` batches (else at the end), gathered across ranks in dataset
order, and handed to ``compute_metrics`` as an ``EvalPrediction`` of numpy arrays. The loss is
averaged per sample, or per label token when the labels are token-level, so it does not depend
on how the data was split into batches or ranks; so are the model's scalar outputs besides the
loss (``model_metrics``: a ponder cost, what a LightningModule's ``self.log`` recorded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from forge.suggest import suggestion
from forge.train import dist
from forge.train.loop_state import model_metrics
from forge.train.loss import IGNORE_INDEX


def labels_of(batch: Mapping[str, Any], label_names: Sequence[str]) -> Any:
    """The batch's labels: one tensor for one label name, a tuple for several, None if any is
    missing."""
    if not label_names or any(batch.get(name) is None for name in label_names):
        return None
    labels = tuple(batch[name].detach() for name in label_names)
    return labels[0] if len(labels) == 1 else labels


def loss_weight(batch_size: int, labels: Any, causal: bool) -> int:
    """How many items a batch's mean loss averages over: its label tokens for token-level
    integer labels (the causal LM's shifted ones), else its samples."""
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
        counted = labels[..., 1:] if causal else labels
        return int((counted != IGNORE_INDEX).sum())
    return batch_size


def output_logits(outputs: Any, ignore_keys: Sequence[str]) -> Any:
    """The model's predictions: every output but the loss (and ``ignore_keys``, such as
    ``past_key_values``, and a mapping's scalars, such as a ponder cost: metrics of the
    batch, not predictions per item); one tensor when there is one."""
    if isinstance(outputs, Mapping):
        logits = tuple(
            v for k, v in outputs.items() if k not in (*ignore_keys, "loss") and not _is_scalar(v)
        )
    elif isinstance(outputs, (tuple, list)):
        logits = tuple(outputs[1:])
    else:
        logits = (outputs,)
    logits = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in logits)
    return logits[0] if len(logits) == 1 else logits


def _is_scalar(value: Any) -> bool:
    return isinstance(value, float) or (isinstance(value, torch.Tensor) and value.dim() == 0)


class Accumulator:
    """One rank's predictions (or labels, inputs, losses) over an evaluation: batches are
    concatenated on the device, padded with -100 on dimension 1, and moved to host memory as
    numpy at every ``to_host()`` (``eval_accumulation_steps``) and at the end."""

    def __init__(self, concat: bool = True) -> None:
        self.concat = concat
        self.on_device: Any = None
        self.on_host: Any = None  # numpy (concatenated), or a list of batches
        self.batches: list[Any] = []

    def add(self, value: Any) -> None:
        if value is None:
            return
        if not self.concat:
            self.batches.append(value)
            return
        from transformers.trainer_pt_utils import nested_concat

        if self.on_device is None:
            self.on_device = value
        else:
            self.on_device = nested_concat(self.on_device, value, padding_index=IGNORE_INDEX)

    def to_host(self) -> None:
        from transformers.trainer_pt_utils import nested_concat, nested_numpify

        if not self.concat:
            self.batches = [nested_numpify(b) if _has_tensor(b) else b for b in self.batches]
            return
        if self.on_device is None:
            return
        value = nested_numpify(self.on_device)
        self.on_device = None
        if self.on_host is None:
            self.on_host = value
        else:
            self.on_host = nested_concat(self.on_host, value, padding_index=IGNORE_INDEX)

    def result(self) -> Any:
        """This rank's values on the host: one (nested) array, or a list of batches."""
        self.to_host()
        return self.batches if not self.concat else self.on_host


def gather_in_order(value: Any, count: int, world_size: int, concat: bool) -> Any:
    """Every rank's ``value`` (``count`` items of its ``forge.data.StridedSampler`` shard) put back in
    dataset order.

    Concatenated values are interleaved item by item; lists of batches are joined step by step
    (step ``i`` of every rank, as HF's per-step gather does)."""
    if world_size == 1:
        return value
    gathered = dist.all_gather_objects((value, count))
    values, lengths = [v for v, _ in gathered], [n for _, n in gathered]
    if all(v is None for v in values):
        return None
    from transformers.trainer_pt_utils import nested_concat

    if not concat:
        steps = max(len(v) for v in values)
        joined = []
        for step in range(steps):
            parts = [v[step] for v in values if step < len(v)]
            merged = parts[0]
            for part in parts[1:]:
                merged = nested_concat(merged, part, padding_index=IGNORE_INDEX)
            joined.append(merged)
        return joined
    merged = values[0]
    for part in values[1:]:
        merged = nested_concat(merged, part, padding_index=IGNORE_INDEX)
    order = np.concatenate(
        [np.arange(rank, world_size * n + rank, world_size)[:n] for rank, n in enumerate(lengths)]
    )
    return _take(merged, np.argsort(order, kind="stable"))


def _take(value: Any, index: np.ndarray) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, index) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: _take(v, index) for k, v in value.items()})
    return value[index]


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    return False


class LossMean:
    """A weighted mean of batch losses (per sample or per token) that skips non-finite batch
    losses when ``nan_inf_filter`` is on and some are finite, as HF's Trainer does."""

    def __init__(self, nan_inf_filter: bool = True) -> None:
        self.nan_inf_filter = nan_inf_filter
        self.finite = [0.0, 0.0]  # weighted sum, weight
        self.all = [0.0, 0.0]

    def add(self, loss: float, weight: int) -> None:
        if weight <= 0:
            return
        self.all[0] += loss * weight
        self.all[1] += weight
        if math.isfinite(loss):
            self.finite[0] += loss * weight
            self.finite[1] += weight

    def reduced(self, all_reduce_sum: Any, device: torch.device) -> tuple[float, float]:
        """(the mean over every rank, its total weight); ``all_reduce_sum`` sums a tensor
        over the ranks."""
        totals = torch.tensor([*self.finite, *self.all], dtype=torch.float64, device=device)
        finite_sum, finite_weight, all_sum, all_weight = all_reduce_sum(totals).tolist()
        if self.nan_inf_filter and finite_weight > 0:
            return finite_sum / finite_weight, finite_weight
        return (all_sum / all_weight if all_weight else float("nan")), all_weight


class OutputMeans:
    """Weighted means of a model's scalar outputs (``model_metrics``) over evaluation batches,
    each batch weighed as its loss is (``loss_weight``); sums stay on the device until
    ``reduced``."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = {}
        self.weights: dict[str, float] = {}

    def add(self, outputs: Any, weight: int) -> None:
        if weight <= 0:
            return
        for name, value in model_metrics(outputs).items():
            value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            held = self.sums.get(name)
            self.sums[name] = value * weight if held is None else held + value * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def reduced(self, all_reduce_sum: Any, device: torch.device, distributed: bool) -> dict:
        """Each output's mean over every rank's batches (the ranks agree on the names first
        when ``distributed``: a rank may have had no batch)."""
        names = sorted(self.sums)
        if distributed:
            names = sorted({name for found in dist.all_gather_objects(names) for name in found})
        if not names:
            return {}
        rows = [
            torch.as_tensor(self.sums.get(name, 0.0), dtype=torch.float64, device=device)
            for name in names
        ]
        weights = torch.tensor(
            [self.weights.get(name, 0.0) for name in names], dtype=torch.float64, device=device
        )
        totals = all_reduce_sum(torch.cat([torch.stack(rows), weights])).tolist()
        count = len(names)
        return {
            name: totals[i] / totals[count + i]
            for i, name in enumerate(names)
            if totals[count + i] > 0
        }


def missing_metric_message(
    args: Any, metric: str, metrics: Mapping[str, Any], step: int, has_compute_metrics: bool
) -> str:
    """``metric_for_best_model`` names a metric the evaluation did not produce: which, where,
    what there is, and the nearest name."""
    produced = list(metrics)
    hint = suggestion(metric, produced, n=1)
    if not has_compute_metrics:
        hint += " (the trainer has no compute_metrics, which gives every metric but the loss)"
    when = f"the evaluation at step {step}" if step else "the evaluation before training"
    return (
        f"{args.config_key}.metric_for_best_model is {metric!r}, but {when} produced only "
        f"{', '.join(produced)}{hint}. Best-model tracking, "
        "load_best_model_at_end, early stopping and the protection of the best checkpoint need "
        "a metric the evaluation produces"
    )
