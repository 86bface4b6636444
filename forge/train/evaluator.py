"""Evaluation and prediction, as Hugging Face's ``Trainer`` runs them, for every forge trainer.

A trainer holds one ``Evaluator`` (``trainer.evaluator``); its public ``evaluate``,
``predict``, ``evaluation_loop`` and ``prediction_step`` (HF's names and signatures) delegate
here, and the loop here calls them back through the trainer, so a subclass that overrides one
of them (as HF subclasses do) is honoured. What differs between trainers is how one batch's
loss and outputs are computed: the trainer's ``forward_eval(model, batch, labels)`` seam (the
pipeline trainer runs the batch through its stages there). A trainer whose ``forward_eval``
gives no outputs (``forward_eval_outputs = False``) reports the loss only.

Each rank runs its share of the dataset (``forge.data.build_eval_loader``); the loss is the
mean over samples, over label tokens for token-level labels, whatever the batching, and
predictions, labels, inputs and losses are gathered across ranks in dataset order for
``compute_metrics`` (forge/train/evaluation.py has the pieces). Evaluation forks the random
generators, so it never changes the training trajectory.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from forge.train.args import TrainingArgumentsError
from forge.train.evaluation import (
    Accumulator,
    LossMean,
    batch_size_of,
    gather_in_order,
    is_causal_lm,
    labels_of,
    loss_weight,
    missing_metric_message,
    output_logits,
)
from forge.train.loop_state import Batch
from forge.train.optim import set_seed
from forge.train.runtime import name_causal_lm_loss

logger = logging.getLogger(__name__)


class Evaluator:
    """Evaluation and prediction for ``trainer`` (a ``BaseTrainer``, which imports this
    module, so it is not named in the annotations); see the module docstring."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._loaders: dict[int, tuple[Any, Any]] = {}  # id -> (dataset, its loader)
        self._warned_outputs = False

    # ------------------------------------------------------------------ HF's entry points
    def evaluate(
        self,
        eval_dataset: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` metrics over ``eval_dataset`` (default: the trainer's),
        each prefixed ``{metric_key_prefix}_``, with HF's speed metrics; a dict of datasets is
        evaluated one by one, each one's metrics prefixed ``eval_NAME_``."""
        trainer = self.trainer
        dataset = trainer.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("trainer.eval_dataset is not set; there is nothing to evaluate")
        parts = dataset if isinstance(dataset, Mapping) else {None: dataset}
        metrics: dict[str, float] = {}
        with trainer.distributed():
            self._prepare_model()
            with trainer.evaluation_weights():  # eval_with_ema: the moving average
                for name, part in parts.items():
                    prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
                    started = time.time()
                    output = trainer.evaluation_loop(
                        part,
                        description=prefix,
                        prediction_loss_only=True if trainer.compute_metrics is None else None,
                        ignore_keys=ignore_keys,
                        metric_key_prefix=prefix,
                    )
                    metrics.update(output.metrics)
                    metrics.update(self._speed_metrics(prefix, started, output.num_samples))
        return metrics

    def predict(
        self,
        test_dataset: Dataset,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """A ``transformers.trainer_utils.PredictionOutput`` over ``test_dataset``."""
        from transformers.trainer_utils import PredictionOutput

        trainer = self.trainer
        with trainer.distributed():
            self._prepare_model()
            started = time.time()
            with trainer.evaluation_weights():
                output = trainer.evaluation_loop(
                    test_dataset,
                    description=metric_key_prefix,
                    ignore_keys=ignore_keys,
                    metric_key_prefix=metric_key_prefix,
                )
        metrics = output.metrics
        metrics.update(self._speed_metrics(metric_key_prefix, started, output.num_samples))
        return PredictionOutput(output.predictions, output.label_ids, metrics)

    def evaluation_loop(
        self,
        dataset: Dataset,
        description: str = "eval",
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """Run the model over this rank's share of ``dataset`` and gather what every rank saw:
        a ``transformers.trainer_utils.EvalLoopOutput`` (predictions, label ids, metrics,
        number of samples), as HF's ``Trainer.evaluation_loop``."""
        from transformers.trainer_utils import EvalLoopOutput, EvalPrediction

        trainer = self.trainer
        args, model, compute_metrics = trainer.args, trainer.model, trainer.compute_metrics
        if prediction_loss_only is None:
            prediction_loss_only = args.prediction_loss_only
        if not type(trainer).forward_eval_outputs:
            prediction_loss_only = True
            self._warn_no_outputs(metric_key_prefix)
        if ignore_keys is None:  # as HF: what the model's config says, e.g. the KV cache
            config = getattr(model, "config", None)
            default = ["past_key_values"] if config is not None else []
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", default))
        streaming = args.batch_eval_metrics and compute_metrics is not None
        if streaming and trainer.topology.dp_size > 1:
            raise TrainingArgumentsError(
                [
                    f"{args.config_key}.batch_eval_metrics computes metrics batch by batch on one "
                    "process; with several processes set it to false"
                ]
            )
        loader = self._loader(dataset, description)
        causal = is_causal_lm(model)
        label_names = trainer.label_names
        main_input = getattr(model, "main_input_name", "input_ids")
        losses, count = LossMean(args.logging_nan_inf_filter), 0
        concat = args.eval_do_concat_batches
        kept = {name: Accumulator(concat) for name in ("preds", "labels", "inputs", "losses")}
        metrics: dict[str, Any] = {}
        was_training = model.training
        model.eval()
        devices = [trainer.device] if trainer.device.type == "cuda" else []
        batches = list(itertools.islice(range(len(loader)), args.max_eval_batches))
        rounds = trainer.eval_forwards(len(batches))
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for step, batch in zip(batches, loader, strict=False):
                batch = trainer._to_device(batch)
                size = batch_size_of(batch)
                loss, logits, labels = trainer.prediction_step(
                    trainer.evaluation_model(),
                    batch,
                    prediction_loss_only,
                    ignore_keys,
                    label_names,
                )
                count += size
                if loss is not None:  # weighed by the batch's labels, predictions asked or not
                    weight = loss_weight(size, labels_of(batch, label_names), causal)
                    losses.add(float(loss), weight)
                if prediction_loss_only:
                    continue
                if logits is not None and trainer.preprocess_logits_for_metrics is not None:
                    logits = trainer.preprocess_logits_for_metrics(logits, labels)
                include = args.include_for_metrics
                batch_losses = loss.repeat(size) if loss is not None and "loss" in include else None
                batch_inputs = batch.get(main_input) if "inputs" in include else None
                if streaming:
                    if logits is not None and labels is not None:
                        metrics = compute_metrics(
                            EvalPrediction(
                                logits, labels, inputs=batch_inputs, losses=batch_losses
                            ),
                            compute_result=step == batches[-1],
                        )
                    continue
                kept["preds"].add(logits)
                kept["labels"].add(labels)
                kept["inputs"].add(batch_inputs)
                kept["losses"].add(batch_losses)
                if args.eval_accumulation_steps and (step + 1) % args.eval_accumulation_steps == 0:
                    for accumulator in kept.values():
                        accumulator.to_host()
            if batches:  # a sharded model's forward is collective: keep every rank in step
                for _ in range(rounds - len(batches)):
                    trainer.prediction_step(
                        trainer.evaluation_model(), batch, True, ignore_keys, label_names
                    )
        model.train(was_training)
        world = trainer.topology.dp_size
        found = {
            name: gather_in_order(acc.result(), count, world, concat) for name, acc in kept.items()
        }
        # every stage of a pipeline replica reads the same items: count them once
        counted = trainer.all_reduce_sum(torch.tensor(float(count), device=trainer.device))
        total = int(counted.item()) // trainer.topology.num_stages
        if (
            compute_metrics is not None
            and not streaming
            and found["preds"] is not None
            and found["labels"] is not None
        ):
            metrics = compute_metrics(
                EvalPrediction(
                    found["preds"],
                    found["labels"],
                    inputs=found["inputs"] if "inputs" in args.include_for_metrics else None,
                    losses=found["losses"] if "loss" in args.include_for_metrics else None,
                )
            )
        elif (
            compute_metrics is not None
            and not streaming
            and not prediction_loss_only
            and metric_key_prefix == "eval"
        ):
            self._warn(
                "compute_metrics was not called: the eval batches hold no labels under %s "
                "(trainer.args.label_names); name the batch keys that hold them",
                label_names,
            )
        metrics = self._checked_metrics(metrics)
        loss, weight = losses.reduced(trainer.all_reduce_sum, trainer.device)
        if weight:  # some rank's batches gave a loss
            metrics["loss"] = loss
            if causal:
                metrics["perplexity"] = math.exp(min(loss, 50.0))
        prefix = f"{metric_key_prefix}_"
        metrics = {k if k.startswith(prefix) else prefix + k: v for k, v in metrics.items()}
        return EvalLoopOutput(found["preds"], found["labels"], metrics, total)

    def prediction_step(
        self,
        model: nn.Module,
        batch: Batch,
        prediction_loss_only: bool,
        ignore_keys: list[str],
        label_names: list[str],
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """One evaluation batch: (mean loss or None, logits or None, labels or None)."""
        labels = labels_of(batch, label_names)
        loss, outputs = self.trainer.forward_eval(model, batch, labels)
        if prediction_loss_only or outputs is None:
            return loss, None, None
        return loss, output_logits(outputs, ignore_keys), labels

    # ------------------------------------------------------------------ what training reads
    def check_best_metric(self, metrics: dict[str, Any]) -> None:
        """``metric_for_best_model`` must be among the evaluation's metrics (as HF checks)."""
        trainer = self.trainer
        metric = trainer.args.metric_for_best_model
        if metric is not None and metric not in metrics:
            message = missing_metric_message(
                trainer.args,
                metric,
                metrics,
                trainer.state.global_step,
                trainer.compute_metrics is not None,
            )
            raise TrainingArgumentsError([message])

    # ------------------------------------------------------------------ helpers
    def _loader(self, dataset: Dataset, description: str) -> Any:
        """The dataset's loader, built once per dataset object."""
        if self._loaders.get(id(dataset), (None,))[0] is not dataset:
            self._loaders[id(dataset)] = (
                dataset,
                self.trainer.build_eval_loader(dataset, description),
            )
        return self._loaders[id(dataset)][1]

    def _prepare_model(self) -> None:
        """Outside ``train()``: build the model (``model_init``), put it on the device and,
        with ``bf16_full_eval`` / ``fp16_full_eval``, in that precision."""
        trainer = self.trainer
        if trainer._in_train:
            return
        args = trainer.args
        if trainer.model is None:
            set_seed(args.seed)
            trainer.model = trainer._call_model_init()
        name_causal_lm_loss(trainer.model)
        dtype = (
            torch.bfloat16
            if args.bf16_full_eval
            else torch.float16
            if args.fp16_full_eval
            else None
        )
        trainer.model.to(device=trainer.device, dtype=dtype)

    def _checked_metrics(self, metrics: Any) -> dict[str, Any]:
        from transformers.trainer_utils import denumpify_detensorize

        if not isinstance(metrics, Mapping):
            raise TypeError(
                "compute_metrics must return a dict of metric name to number (got "
                f"{type(metrics).__name__})"
            )
        return dict(denumpify_detensorize(dict(metrics)))

    def _speed_metrics(self, prefix: str, started: float, num_samples: int) -> dict[str, float]:
        from transformers.trainer_utils import speed_metrics

        trainer = self.trainer
        per_rank = trainer.per_rank_batch_size("per_device_eval_batch_size")
        batch = per_rank * trainer.topology.dp_size
        steps = math.ceil(num_samples / batch) if num_samples else 0
        return speed_metrics(prefix, started, num_samples=num_samples, num_steps=steps)

    def _warn_no_outputs(self, prefix: str) -> None:
        if self.trainer.compute_metrics is None or self._warned_outputs:
            return
        self._warned_outputs = True
        self._warn(
            "compute_metrics is not run by the %s trainer (its evaluation computes the loss "
            "only); it reports %s_loss",
            self.trainer.trainer_kind,
            prefix,
        )

    def _warn(self, message: str, *values: Any) -> None:
        """A warning on rank 0 only (every rank reaches the same ones)."""
        if self.trainer.is_main_process:
            logger.warning(message, *values)
