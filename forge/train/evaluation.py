"""Evaluation and prediction, as Hugging Face's ``Trainer`` runs them, for every forge trainer.

``Evaluation`` is the part of the trainer that holds HF's entry points with their names and
signatures: ``evaluate``, ``predict``, ``evaluation_loop`` and ``prediction_step`` (a subclass
that overrides one of them, as HF subclasses do, is honoured). What differs between trainers is
how one batch goes forward: the strategy's ``forward_eval`` (the pipeline runs the batch
through its stages there); a strategy that gives no outputs reports the loss only.

Each rank runs its share of the dataset (``forge.data.build_eval_loader``); the loss is the
mean over samples, over label tokens for token-level labels, whatever the batching, and
predictions, labels, inputs and losses are gathered across ranks in dataset order for
``compute_metrics`` (forge/train/predictions.py has the pieces). The model's scalar outputs
besides the loss (a ponder cost, what a LightningModule logs) are averaged as the loss is and
reported as ``eval_NAME``, beside what ``compute_metrics`` returns. Evaluation forks the random
generators, so nothing it runs (a forward, a sampling ``generate``, ``compute_metrics``) changes
the training trajectory, except what HF's Trainer and Lightning's evaluations also take from it:
each pass over an evaluation loader starts a ``DataLoader`` iterator, which draws its base seed
from torch's global generator, so a port trained with dropout keeps the original's losses
through and after its evaluations. The weights it runs with may be chosen by a callback
(``evaluation_weights``: a moving average of the weights).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from forge.train import generation
from forge.train.args import TrainingArgumentsError
from forge.train.batch_finder import free_cached_memory, is_out_of_memory
from forge.train.loop_state import Batch
from forge.train.loss import batch_size_of, is_causal_lm, returned_loss
from forge.train.optim import set_seed
from forge.train.packing import sequence_count
from forge.train.predictions import (
    Accumulator,
    LossMean,
    OutputMeans,
    gather_in_order,
    labels_of,
    loss_weight,
    missing_metric_message,
    output_logits,
)
from forge.train.runtime import name_causal_lm_loss
from forge.train.user_code import call_user_code

logger = logging.getLogger(__name__)


class Evaluation:
    """Evaluation and prediction for the trainer this is part of (forge/train/loop.py);
    see the module docstring."""

    def init_evaluation(self) -> None:
        self._eval_loaders: dict[int, tuple[Any, Any]] = {}  # id -> (dataset, its loader)
        self._warned_outputs = False
        self._output_means: OutputMeans | None = None  # during an evaluation's batches
        #: auto_find_batch_size's evaluation batch, once one ran out of memory (None: as set)
        self.eval_batch_size: int | None = None
        # generation (predict_with_generate): generate's keywords, the generation config
        self._gen_kwargs = generation.generation_kwargs(self.args, {})
        self.generation_config = generation.load_generation_config(self.args)
        if self.args.predict_with_generate and not self.strategy.gives_eval_outputs:
            raise TrainingArgumentsError(
                [
                    f"{self.args.config_key}.predict_with_generate is true, but the "
                    f"{self.trainer_kind} trainer's evaluation gives no outputs to generate "
                    "from (it reports the loss only); evaluate with the plain or Accelerate "
                    "trainer, or set it to false"
                ]
            )
        if self.args.predict_with_generate and self.strategy.collective_forward:
            raise TrainingArgumentsError(
                [
                    f"{self.args.config_key}.predict_with_generate does not run under fsdp yet "
                    "(a sharded model's generate); generate in evaluation under DDP (drop "
                    "fsdp), or set it to false"
                ]
            )
        if self.model is not None:
            self.prepare_generation(self.model)

    def prepare_generation(self, model: nn.Module) -> None:
        """Give a model that was just built ``generation_config``, and check it generates
        where evaluation will (forge/train/generation.py)."""
        generation.prepare_model(model, self.args, self.generation_config)

    # ------------------------------------------------------------------ HF's entry points
    def evaluate(
        self,
        eval_dataset: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` metrics over ``eval_dataset`` (default: the trainer's),
        each prefixed ``{metric_key_prefix}_``, with HF's speed metrics, reported to the
        callbacks (``on_evaluate``).

        The loss is the mean over samples (over label tokens for token-level labels), reduced
        over ranks; a causal LM also gets ``eval_perplexity``. A dict of datasets is evaluated
        one by one, each one's metrics prefixed ``eval_NAME_`` (as HF's Trainer does).
        ``gen_kwargs`` are ``generate``'s keywords with ``predict_with_generate`` (as HF's
        Seq2SeqTrainer takes them).
        """
        self._gen_kwargs = generation.generation_kwargs(self.args, gen_kwargs)
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("trainer.eval_dataset is not set; there is nothing to evaluate")
        parts = dataset if isinstance(dataset, Mapping) else {None: dataset}
        metrics: dict[str, float] = {}
        with self.strategy.process_group():
            self._prepare_eval_model()
            with self._evaluation_weights():
                for name, part in parts.items():
                    prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
                    started = time.time()
                    output = self.evaluation_loop(
                        part,
                        description=prefix,
                        prediction_loss_only=True if self.compute_metrics is None else None,
                        ignore_keys=ignore_keys,
                        metric_key_prefix=prefix,
                    )
                    metrics.update(output.metrics)
                    metrics.update(self._speed_metrics(prefix, started, output.num_samples))
        if self._in_train:
            if self.args.metric_for_best_model:
                # the best metric so far is the one the save in flight records: its commit
                # must have given it to the state before this evaluation is judged
                self.checkpoints.wait()
            metrics["epoch"] = self.state.epoch
            self._check_best_metric(metrics)
        self._last_eval = (self.state.global_step, metrics)
        self._call("on_evaluate", metrics=metrics)
        return metrics

    def predict(
        self,
        test_dataset: Dataset,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> Any:
        """Predictions (and, where the dataset has labels, labels and metrics) over
        ``test_dataset``: a ``transformers.trainer_utils.PredictionOutput``; with
        ``predict_with_generate`` the predictions are generated ids (``gen_kwargs`` as in
        ``evaluate``)."""
        from transformers.trainer_utils import PredictionOutput

        self._gen_kwargs = generation.generation_kwargs(self.args, gen_kwargs)

        with self.strategy.process_group():
            self._prepare_eval_model()
            started = time.time()
            with self._evaluation_weights():
                output = self.evaluation_loop(
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
        kwargs = dict(
            description=description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        was_training = self.model.training
        while True:
            try:
                return self._evaluation_pass(dataset, **kwargs)
            except Exception as error:
                if not (self.args.auto_find_batch_size and is_out_of_memory(error)):
                    raise
                self.model.train(was_training)
                failed = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
            # out of the except block: the failed pass's frames and tensors are gone
            self._shrink_eval_batch(dataset, failed)

    def _shrink_eval_batch(self, dataset: Dataset, failed: str) -> None:
        """``auto_find_batch_size``: half the evaluation batch, its loader built anew."""
        size = self.eval_batch_size or self.strategy.per_rank_batch_size(
            "per_device_eval_batch_size"
        )
        if size == 1:
            raise torch.OutOfMemoryError(
                f"evaluation out of memory with batches of 1 item ({failed}); "
                "auto_find_batch_size cannot go lower"
            )
        self.eval_batch_size = (size + 1) // 2
        self._eval_loaders.pop(id(dataset), None)
        free_cached_memory()
        self._warn(
            "auto_find_batch_size: evaluation out of memory with batches of %d items (%s); "
            "evaluating again with %d (the metrics do not depend on it)",
            size,
            failed,
            self.eval_batch_size,
        )

    def _evaluation_pass(
        self,
        dataset: Dataset,
        description: str,
        prediction_loss_only: bool | None,
        ignore_keys: list[str] | None,
        metric_key_prefix: str,
    ) -> Any:
        """One pass of ``evaluation_loop`` at the evaluation batch size of now."""
        from transformers.trainer_utils import EvalLoopOutput, EvalPrediction

        args, model = self.args, self.model
        compute_metrics, preprocess = self._located_metrics(metric_key_prefix)
        if prediction_loss_only is None:
            prediction_loss_only = args.prediction_loss_only
        if not self.strategy.gives_eval_outputs:
            prediction_loss_only = True
            self._warn_no_outputs(metric_key_prefix)
        if ignore_keys is None:  # as HF: what the model's config says, else the KV cache
            config = getattr(model, "config", None)
            # the cache is "cache" in transformers 5, "past_key_values" before: never a prediction
            default = ["cache", "past_key_values"] if config is not None else []
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", default))
        streaming = args.batch_eval_metrics and compute_metrics is not None
        if streaming and self.topology.dp_size > 1:
            raise TrainingArgumentsError(
                [
                    f"{args.config_key}.batch_eval_metrics computes metrics batch by batch on one "
                    "process; with several processes set it to false"
                ]
            )
        loader = self._eval_loader(dataset, description)
        causal = is_causal_lm(model)
        label_names = self.label_names
        main_input = getattr(model, "main_input_name", "input_ids")
        losses, count = LossMean(args.logging_nan_inf_filter), 0
        concat = args.eval_do_concat_batches
        kept = {name: Accumulator(concat) for name in ("preds", "labels", "inputs", "losses")}
        metrics: dict[str, Any] = {}
        was_training = model.training
        model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        batches = list(itertools.islice(range(len(loader)), args.max_eval_batches))
        rounds = self.strategy.eval_forwards(len(batches))
        self._output_means = output_means = OutputMeans()  # _forward_eval adds to it
        # iterated outside the fork, as HF's and Lightning's loops iterate theirs: a DataLoader's
        # iterator draws its base seed from the global generator, and training goes on from there
        loader_batches = iter(loader)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for step, batch in zip(batches, loader_batches, strict=False):
                batch = self._to_device(batch)
                size = batch_size_of(batch)
                loss, logits, labels = self.prediction_step(
                    self.evaluation_model(), batch, prediction_loss_only, ignore_keys, label_names
                )
                packed = sequence_count(batch)  # a packed row holds several items
                count += size if packed is None else int(packed)
                if loss is not None:  # weighed by the batch's labels, predictions asked or not
                    weight = loss_weight(size, labels_of(batch, label_names), causal)
                    losses.add(float(loss), weight)
                if prediction_loss_only:
                    continue
                if logits is not None and preprocess is not None:
                    logits = preprocess(logits, labels)
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
            self._output_means = None  # what follows repeats a batch
            if batches:  # a sharded model's forward is collective: keep every rank in step
                for _ in range(rounds - len(batches)):  # generating too, if the others do
                    self.prediction_step(
                        self.evaluation_model(),
                        batch,
                        prediction_loss_only,
                        ignore_keys,
                        label_names,
                    )
        model.train(was_training)
        world = self.topology.dp_size
        found = {
            name: gather_in_order(acc.result(), count, world, concat) for name, acc in kept.items()
        }
        # every stage of a pipeline replica reads the same items: count them once
        counted = self.all_reduce_sum(torch.tensor(float(count), device=self.device))
        total = int(counted.item()) // self.topology.num_stages
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
        if self.strategy.gives_eval_outputs:  # compute_metrics' names win over the outputs'
            outputs = output_means.reduced(
                self.all_reduce_sum, self.device, self.topology.distributed
            )
            metrics = {**outputs, **metrics}
        loss, weight = losses.reduced(self.all_reduce_sum, self.device)
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
        **gen_kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """One evaluation batch: (mean loss or None, logits or None, labels or None); with
        ``predict_with_generate``, the generated ids in place of the logits (``gen_kwargs``, else
        those ``evaluate``/``predict`` resolved)."""
        labels = labels_of(batch, label_names)
        if self.args.predict_with_generate and not prediction_loss_only:
            return generation.generation_step(self, model, batch, labels, gen_kwargs)
        loss, outputs = self.strategy.forward_eval(
            batch, lambda: self._forward_eval(model, batch, labels)
        )
        if prediction_loss_only or outputs is None:
            return loss, None, None
        return loss, output_logits(outputs, ignore_keys), labels

    def _forward_eval(
        self, model: nn.Module, batch: Batch, labels: Any
    ) -> tuple[torch.Tensor | None, Any]:
        """One evaluation batch's mean loss on this rank (None when there is none) and the
        model's outputs, from which the predictions are read. With labels the loss is
        ``compute_loss``'s (``compute_loss_func`` and label smoothing included); without, a
        loss the model returns still counts."""
        if labels is not None:
            num_items = self.loss.num_items_in_batch([batch], self.model)
            items = {} if num_items is None else {"num_items_in_batch": num_items}
            loss, outputs = self.compute_loss(model, batch, return_outputs=True, **items)
            loss = loss.detach().mean()
        else:
            outputs = model(**batch)
            found = returned_loss(outputs)  # read as training reads it (a tuple's first too)
            loss = found.detach().mean() if isinstance(found, torch.Tensor) else None
        if self._output_means is not None:  # weighed as the loss is
            weight = loss_weight(batch_size_of(batch), labels, is_causal_lm(self.model))
            self._output_means.add(outputs, weight)
        return loss, outputs

    # ------------------------------------------------------------------ helpers
    def _located_metrics(self, prefix: str) -> tuple[Any, Any]:
        """``compute_metrics`` and ``preprocess_logits_for_metrics``, each failure of theirs a
        ``UserCodeFailure`` naming the part and the evaluation (as the sanity pass names it)."""
        when = f"the evaluation at step {self.state.global_step}" if self._in_train else prefix
        found = []
        for part, doing in (
            ("compute_metrics", f"computing the metrics of {when}"),
            ("preprocess_logits_for_metrics", f"preprocessing the logits of {when}"),
        ):
            function = getattr(self, part)
            located = functools.partial(call_user_code, part, doing, function)
            found.append(None if function is None else located)
        return found[0], found[1]

    def _evaluation_weights(self) -> Any:
        """The weights evaluation runs with, as the callbacks choose them (a moving average
        swapped in for the evaluation and out again after it); the model's own otherwise."""
        return self.callback_handler.evaluation_weights(self.args, self.state, self.control)

    def _check_best_metric(self, metrics: dict[str, Any]) -> None:
        """``metric_for_best_model`` must be among the evaluation's metrics (as HF checks)."""
        metric = self.args.metric_for_best_model
        if metric is not None and metric not in metrics:
            message = missing_metric_message(
                self.args,
                metric,
                metrics,
                self.state.global_step,
                self.compute_metrics is not None,
            )
            raise TrainingArgumentsError([message])

    def _eval_loader(self, dataset: Dataset, description: str) -> Any:
        """The dataset's loader, built once per dataset object."""
        if self._eval_loaders.get(id(dataset), (None,))[0] is not dataset:
            self._eval_loaders[id(dataset)] = (
                dataset,
                self.build_eval_loader(dataset, description),
            )
        return self._eval_loaders[id(dataset)][1]

    def _prepare_eval_model(self) -> None:
        """Outside ``train()``: build the model (``model_init``), put it on the device and,
        with ``bf16_full_eval`` / ``fp16_full_eval``, in that precision."""
        if self._in_train:
            return
        args = self.args
        if self.model is None:
            set_seed(args.seed)
            self.model = self._call_model_init()
            self.prepare_generation(self.model)
        name_causal_lm_loss(self.model)
        dtype = (
            torch.bfloat16
            if args.bf16_full_eval
            else torch.float16
            if args.fp16_full_eval
            else None
        )
        self.model.to(device=self.device, dtype=dtype)

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

        per_rank = self.strategy.per_rank_batch_size("per_device_eval_batch_size")
        batch = per_rank * self.topology.dp_size
        steps = math.ceil(num_samples / batch) if num_samples else 0
        return speed_metrics(prefix, started, num_samples=num_samples, num_steps=steps)

    def _warn_no_outputs(self, prefix: str) -> None:
        if self.compute_metrics is None or self._warned_outputs:
            return
        self._warned_outputs = True
        self._warn(
            "compute_metrics is not run by the %s trainer (its evaluation computes the loss "
            "only); it reports %s_loss",
            self.trainer_kind,
            prefix,
        )

    def _warn(self, message: str, *values: Any) -> None:
        """A warning on rank 0 only (every rank reaches the same ones)."""
        if self.is_main_process:
            logger.warning(message, *values)
