"""The training loop every forge trainer shares.

``BaseTrainer.train`` reads top to bottom: batch, forward, backward, clip, step, log,
evaluate, save, stop. A trainer differs in two public seams: ``parallelize(model)``, the last
step of the model-transform stage (``transform_model``: build, adapters, activation
checkpointing, compile, then DDP / Accelerate's prepare / the pipeline's stages), and
``forward_backward(window)`` (the micro-batches of one optimizer step), plus the small step
methods they use (``backward``, ``no_sync``, ``autocast``, ``clip_gradients``,
``optimizer_step``, ``reduce_step``, ``distributed``), ``forward_eval`` (one evaluation
batch; the ``Evaluator`` of forge/train/evaluator.py runs the rest of evaluation for every
trainer) and what it registers as checkpoint state (``register_components``, with
``model_component`` / ``optimizer_component`` for how the weights and optimizer are saved;
callbacks add theirs in ``on_register``). The loaders
are built by forge/data/trainer_loaders.py from plain arguments.

Resume is exact: every piece of state a step reads (weights, optimizer, scheduler, grad
scaler, step counters, callback state, data position, random generators) is a checkpoint
component (forge/checkpoint/registry.py), saved at a step boundary and restored before the
first resumed step in registration order, random generators last.
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from forge.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointRegistry,
    CheckpointSnapshot,
    CheckpointWriter,
    Component,
    ModelWeights,
    OptimizerState,
    RngState,
    Scope,
    checkpoint_name,
    load_model_weights,
    resume_checkpoint,
    rotate_checkpoints,
    unwrap_model,
)
from forge.checkpoint.adapter import AdapterWeights
from forge.checkpoint.background import BackgroundCommit
from forge.checkpoint.snapshot import HostCopier, HostStaging, stepped_by
from forge.data import trainer_loaders
from forge.data.columns import ModelInputs
from forge.train import dist
from forge.train.adapters import (
    loss_from_outputs,
    model_loss,
    not_a_dict_batch,
    split_labels,
    takes_keyword,
)
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.callbacks import (
    CallbackHandler,
    EarlyStoppingCallback,
    EmptyCacheCallback,
    JsonlMetricsCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from forge.train.components import DataPosition
from forge.train.ema import EMA_COMPONENT, WeightsEMA, read_ema_component
from forge.train.evaluation import (
    IGNORE_INDEX,
    accepts_loss_kwargs,
    batch_size_of,
    is_causal_lm,
    loss_shifts_labels,
    resolve_label_names,
)
from forge.train.evaluator import Evaluator
from forge.train.integrations import integration_callback
from forge.train.loop_state import Batch, StepResult, Tally, TrainOutput, count_tokens
from forge.train.memory import peak_memory
from forge.train.optim import (
    MetricSchedule,
    build_optimizer,
    build_scheduler,
    current_lr,
    set_seed,
)
from forge.train.precision import device_problems, numerics
from forge.train.runtime import Intervals, apply_runtime_settings
from forge.train.signals import StopSignals, TrainingInterrupted
from forge.train.topology import Topology
from forge.train.transforms import (
    activation_checkpointing_problems,
    apply_activation_checkpointing,
    apply_model_settings,
)
from forge.wrappers import is_peft_model

logger = logging.getLogger(__name__)


class BaseTrainer:
    """The shared loop; see the module docstring. Subclasses set ``trainer_kind``.

    ``model`` is an ``nn.Module`` or a zero-argument callable that builds one (as Hugging Face's
    ``model_init``): the trainer calls it after ``set_seed(args.seed)`` at the start of every
    ``train()``, so weight initialisation is seeded and a resumed run rebuilds the same model.
    ``optimizer`` is None (AdamW from ``args``) or a callable taking the trainable parameters;
    ``lr_scheduler`` is None (``args.lr_scheduler_type``) or a callable taking
    ``(optimizer, num_training_steps)``. Datasets are map-style and yield dicts (tuples:
    ``forge.data.TupleCollator`` names their parts); the loss is ``model(**batch).loss`` (or
    ``["loss"]``; a model returning a bare tensor is wrapped in ``forge.train.LossAdapter``),
    or what ``compute_loss_func`` computes, unless ``compute_loss`` is overridden. A
    ``tokenizer`` (HF 5's ``processing_class``) is saved into every checkpoint. ``peft_config``
    (a peft config, e.g. ``LoraConfig``, as TRL's trainers take it) fine-tunes the model with a
    peft adapter: its base frozen, each checkpoint holding only the adapter
    (forge/train/lora.py).

    ``compute_loss_func(outputs, labels, num_items_in_batch=...)`` is Hugging Face's: the
    batch's ``labels`` are taken out of the batch, the model is called on the rest, and the
    function computes the loss from the model's outputs and the labels. A function that takes
    ``num_items_in_batch`` gets the label tokens (not -100) of the whole optimizer step (all
    its micro-batches, the first token of each row left out for a causal LM, over every
    data-parallel rank with ``average_tokens_across_devices``) and returns the loss
    normalised by it, e.g. ``loss_sum / num_items_in_batch``; forge then neither averages it
    over the accumulation window nor over the ranks, as HF's Trainer does. A function without
    that parameter returns a per-batch mean, averaged over the window like a model's loss.

    ``compute_metrics(EvalPrediction) -> dict`` and ``preprocess_logits_for_metrics(logits,
    labels)`` are Hugging Face's: evaluation hands the gathered predictions and labels (numpy)
    to ``compute_metrics``, and its metrics are reported with the ``eval_`` prefix.
    """

    trainer_kind: ClassVar[str] = "base"
    #: constructor arguments a trainer cannot honour, with the reason and what to use instead
    unsupported_arguments: ClassVar[dict[str, str]] = {}
    #: whether ``forward_eval`` gives the model's outputs (predictions for compute_metrics)
    forward_eval_outputs: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        args: TrainingArguments,
        train_dataset: Dataset,
        eval_dataset: Dataset | None = None,
        data_collator: Callable[[list[Any]], Batch] | None = None,
        tokenizer: Any = None,
        optimizer: Callable[[list[nn.Parameter]], Optimizer] | Optimizer | None = None,
        lr_scheduler: Callable[[Optimizer, int], LRScheduler] | LRScheduler | None = None,
        callbacks: list[TrainerCallback] | tuple[TrainerCallback, ...] = (),
        compute_metrics: Callable[[Any], dict[str, float]] | None = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        processing_class: Any = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        peft_config: Any = None,
    ) -> None:
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"trainer.args must be TrainingArguments (got {type(args).__name__})")
        if not isinstance(model, nn.Module) and not callable(model):
            raise TypeError(
                "trainer.model must be an nn.Module or a callable that builds one "
                f"(got {type(model).__name__})"
            )
        if processing_class is not None and tokenizer is not None:
            raise TypeError(
                "trainer got both tokenizer and processing_class (HF 5's name for it); pass one"
            )
        for name, value in (
            ("compute_metrics", compute_metrics),
            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
            ("compute_loss_func", compute_loss_func),
        ):
            if value is not None and not callable(value):
                raise TypeError(
                    f"trainer.{name} must be a function (got {type(value).__name__}); in a config "
                    f"write it as !partial:./metrics.py:{name} []"
                )
            if value is not None and name in self.unsupported_arguments:
                raise TrainingArgumentsError(
                    [f"trainer.{name}: {self.unsupported_arguments[name]}"]
                )
        if peft_config is not None and "peft_config" in self.unsupported_arguments:
            raise TrainingArgumentsError(
                [f"trainer.peft_config: {self.unsupported_arguments['peft_config']}"]
            )
        self.args = args
        self.peft_config = peft_config
        self._lora_base: dict[str, Any] | None = None  # the run's record of its frozen base
        self.model_init = None if isinstance(model, nn.Module) else model
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = data_collator
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.compute_loss_func = compute_loss_func
        self._loss_func_takes_items = compute_loss_func is not None and takes_keyword(
            compute_loss_func, "num_items_in_batch"
        )
        self._warned_no_labels = False
        self._label_smoother = None
        if args.label_smoothing_factor:
            from transformers.trainer_pt_utils import LabelSmoother

            self._label_smoother = LabelSmoother(epsilon=args.label_smoothing_factor)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.topology = self.make_topology()
        self.device = self._resolve_device()
        self._check_eval_dataset()
        if self.model is not None:  # a builder's model is checked when it is built
            problems = activation_checkpointing_problems(self.model, args)
            if problems:
                raise TrainingArgumentsError(problems)

        self.state = TrainerState(is_world_process_zero=self.topology.is_main)
        self.control = TrainerControl()
        user_callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks]
        self.callback_handler = CallbackHandler(
            self.default_callbacks(user_callbacks) + user_callbacks
        )
        self.evaluator = Evaluator(self)

        # built by train()
        self.wrapped_model: nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self.lr_scheduler: LRScheduler | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.train_loader: Any = None
        self.max_steps = 0
        self.num_epochs = 0
        self.data_position = DataPosition()  # where the loop is in the data
        self.checkpoint_registry: CheckpointRegistry | None = None  # built by train()
        self.ema: WeightsEMA | None = None  # the weights' moving average (ema_decay)
        self._step_listeners: list[Callable[..., None]] = []  # their on_optimizer_step
        self._early_components: list[Component] = []  # registered by the transform stage
        # several ranks agree on a signal only at steps that sync anyway (see _should_stop)
        self._signals = StopSignals(
            "the next step that logs, evaluates or saves"
            if self.topology.distributed
            else "the next step"
        )
        self._tally = Tally()
        self._last_eval: tuple[int | None, dict[str, float]] = (None, {})
        self._last_save_step: int | None = None
        # what the checkpoint being snapshotted records of the loop's state (itself as the last
        # checkpoint, and as the best if it is): the live state changes only once it is committed
        self._saving: dict[str, Any] = {}
        self._commits = BackgroundCommit()  # async_save: the commit in flight, if any
        self._copy_gate = HostCopier()  # async_save: the snapshot copies still to be made
        self._staging: HostStaging | None = None  # async_save on CUDA: reused pinned buffers
        self._commit_group: Any = None  # async_save, distributed: the commit's own gloo group
        self._eval_model: nn.Module | None = None
        self._in_train = False
        self._counts_flops = False  # the model estimates its floating-point operations
        self._every = Intervals()

    # ------------------------------------------------------------------ properties
    def make_topology(self) -> Topology:
        """This process's place in the job, from the launcher's environment."""
        return Topology.from_env()

    def _resolve_device(self) -> torch.device:
        """This rank's device, checked against the launcher's LOCAL_RANK and against the
        precision ``args`` ask for, so a mismatch fails here rather than at the first step."""
        args = self.args
        topology = self.topology
        try:
            device = dist.resolve_device(args.device, topology.local_rank, topology.world_size)
        except ValueError as exc:
            raise TrainingArgumentsError([f"{args.config_key}.device {exc}"]) from None
        problems = device_problems(args, device)
        if problems:
            raise TrainingArgumentsError(problems)
        return device

    @property
    def is_main_process(self) -> bool:
        return self.topology.is_main

    @property
    def checkpoints_dir(self) -> Path:
        return Path(self.args.output_dir) / "checkpoints"

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (an instance or a class to instantiate)."""
        self.callback_handler.add(callback)

    def default_callbacks(self, user_callbacks: list[TrainerCallback]) -> list[TrainerCallback]:
        """On rank 0 the console progress, ``metrics.jsonl`` and the ``args.report_to``
        integrations; early stopping and cache emptying where asked."""
        callbacks: list[TrainerCallback] = []
        if self.is_main_process:
            callbacks += [ProgressCallback(), JsonlMetricsCallback()]
            callbacks += [integration_callback(name) for name in self.args.report_to]
        if self.args.torch_empty_cache_steps:
            callbacks.append(EmptyCacheCallback())
        has_early_stopping = any(isinstance(cb, EarlyStoppingCallback) for cb in user_callbacks)
        if self.args.early_stopping_patience and not has_early_stopping:
            callbacks.append(EarlyStoppingCallback())
        return callbacks

    # ------------------------------------------------------------------ the loop
    def train(
        self, resume_from_checkpoint: bool | str | os.PathLike | Checkpoint | None = None
    ) -> TrainOutput:
        """Train to ``max_steps`` (or ``num_train_epochs``), optionally resuming first.

        ``resume_from_checkpoint`` (None: ``args.resume_from_checkpoint``) is False, True (the
        newest valid checkpoint of this run, else of its sibling ``run_*`` directories; a
        warning and a fresh start when there is none), a checkpoint or run path, or a
        ``Checkpoint`` resolved (and hashed) already by forge.checkpoint.resolve. SIGINT / SIGTERM
        stop at the next step boundary with a checkpoint and raise ``TrainingInterrupted``.
        """
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        with self.distributed(), numerics(self.args):
            try:
                self._in_train = True
                self._setup_training()
                checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
                if checkpoint is not None:
                    self._load_checkpoint(checkpoint.path)
                with self._signals:
                    output = self._train_loop()
                self.wait_for_checkpoint()
                return output
            except Exception as error:
                # A background commit that failed is why the run stops, even where the training
                # thread fails first: another rank that stopped for it breaks this rank's next
                # collective, whose error says nothing of the cause.
                failure = self._commits.failure()
                if isinstance(failure, Exception):
                    logger.debug("the training thread stopped with: %s", error)
                    raise failure from error
                raise
            finally:
                self._commits.wait_quietly()  # a failed run still finishes the commit in flight
                self._in_train = False
                self.release_wrappers()

    def _train_loop(self) -> TrainOutput:
        args, state = self.args, self.state
        self._log_start()
        self._call("on_train_begin")
        if args.eval_on_start and self._evaluation_enabled():
            self._evaluate_in_training(start=True)  # a first check of metrics and eval data
        self.wrapped_model.train()
        start_step, run_tally = state.global_step, Tally()
        self._tally.started = run_tally.started  # tokens/s counts training time only
        for epoch in itertools.count(self.data_position.epoch):  # until max_steps (or a stop)
            for micro_batches in self._accumulation_windows(epoch):
                loss, tokens = self.forward_backward(micro_batches)
                grad_norm = self.clip_gradients()
                samples, flops = self._count_work(micro_batches)  # host numbers: no sync
                step = self.reduce_step(loss, tokens, grad_norm, samples, flops)  # every rank's
                applied = self._step_unless_nonfinite(step)
                self._optimizer_stepped(applied)
                self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self._advance(step, run_tally)
                self._call("on_step_end")
                synced = self._log_evaluate_save(epoch_end=False)
                if self._should_stop(synced):
                    break
            synced = self.data_position.epoch > epoch  # the epoch ran to its end
            if synced:
                synced = self._log_evaluate_save(epoch_end=True)
            if self._should_stop(synced):
                break
        return self._finish(state.global_step - start_step, run_tally)

    def _accumulation_windows(self, epoch: int) -> Iterator[list[Batch]]:
        """The epoch's micro-batches, ``gradient_accumulation_steps`` at a time.

        A short last window steps with what it has. ``self.data_position`` always says how
        many micro-batches were taken, so a checkpoint between two windows resumes exactly.
        """
        position = self.data_position
        batches = position.epoch_batches(epoch)
        accumulation = self.args.gradient_accumulation_steps
        while self.state.global_step < self.max_steps and (
            window := list(itertools.islice(batches, accumulation))
        ):
            position.took(len(window))
            yield window
        if self.state.global_step < self.max_steps:
            position.end_epoch()

    def _advance(self, step: StepResult, run_tally: Tally) -> None:
        """Count the step; its numbers stay on the device until ``_settle``."""
        state = self.state
        state.global_step += 1
        state.epoch = self.data_position.fraction
        self._tally.add(step)
        run_tally.add(step)

    def _settle(self) -> None:
        """Read the steps' numbers since the last settle into the state (tokens seen, steps
        skipped). It waits for the device, so only logging steps and checkpoints call it."""
        flops = self._tally.flops
        settled = self._tally.settle()
        self.state.total_flos += self._tally.flops - flops
        if settled.skipped and self.args.skip_nonfinite:
            self.state.nonfinite_skipped += settled.skipped
            self._info(
                "%d step(s) up to step %d had a non-finite loss or gradient norm; their "
                "optimizer steps were skipped (%d skipped so far)",
                settled.skipped,
                self.state.global_step,
                self.state.nonfinite_skipped,
                level=logging.WARNING,
            )
        self.state.tokens_seen += settled.tokens

    def _log_evaluate_save(self, *, epoch_end: bool) -> bool:
        """Log, evaluate and save where the strategies, or a callback's flags, ask for it;
        ``save_strategy: "best"`` saves after an evaluation that improved the best metric.

        Returns whether it did any of them: each waits for the device, so the step has synced.
        """
        args, state, control, every = self.args, self.state, self.control, self._every
        step = state.global_step
        self._commits.raise_if_failed()  # an async commit that failed ends the run here
        if epoch_end:
            log = args.logging_strategy == "epoch"
            evaluate = args.eval_strategy == "epoch" and state.epoch >= args.eval_delay
            save = args.save_strategy == "epoch"
        else:
            first = args.logging_first_step and step == 1
            log = control.should_log or first or every.due("logging", step)
            evaluate = control.should_evaluate or (
                every.due("eval", step) and step >= args.eval_delay
            )
            save = control.should_save or every.due("save", step)
            control.reset_step_flags()
        if save and step >= self.max_steps:
            evaluate = True  # the final evaluation belongs to the final checkpoint
        evaluate = evaluate and self._evaluation_enabled()
        if log:
            self.log_step()
        if evaluate:
            improved = self._evaluate_in_training()
            save = save or (improved and args.save_strategy == "best")
        if save:
            self.save_checkpoint()
        return log or evaluate or save

    def _should_stop(self, synced: bool) -> bool:
        """Max steps, a callback's request, or a signal (which saves and raises).

        One process acts on a signal at the next step boundary. The ranks of a distributed
        job must agree on it, which takes a collective and a host sync, so they do that only
        at a step that has ``synced`` anyway (it logged, evaluated or saved): a signal stops
        such a job within ``logging_steps`` steps. torchrun passes signals to every rank.
        """
        self._finish_commit(synced)
        signum = self._signals.received
        if self.topology.distributed:
            signum = int(self._agree_max(signum)) if synced else 0
        if signum:
            checkpoint = self.save_checkpoint()
            self.wait_for_checkpoint()
            self._call("on_train_end", interrupted=signum)
            raise TrainingInterrupted(signum, self.state.global_step, str(checkpoint))
        return self.state.global_step >= self.max_steps or self.control.should_training_stop

    def _finish_commit(self, synced: bool) -> None:
        """``async_save``: what follows a background commit that has ended (last and best
        checkpoint, rotation, ``on_save``), in the training thread. Every rank of a job runs it
        at the same step, so callbacks act alike on all of them: at a step that has ``synced``
        anyway, once all agree that their commit ended (a collective, only while one is
        pending). A failed commit is raised at once, on any step."""
        commits = self._commits
        if not commits.pending:
            return
        if not self.topology.distributed:
            commits.poll()
            return
        commits.raise_if_failed()
        if synced and not self._agree_max(0.0 if commits.ended else 1.0):
            commits.wait()

    def _finish(self, steps: int, run_tally: Tally) -> TrainOutput:
        args, state = self.args, self.state
        if self._tally.steps and args.logging_strategy != "no":
            self.log_step()  # the steps since the last log
        run_tally.settle()
        if self._evaluation_enabled():
            self._evaluate_in_training()
        if args.save_final_checkpoint:
            self.save_checkpoint()
        self.wait_for_checkpoint()  # the best checkpoint and run.json are final from here on
        self._settle()
        summary = self._train_summary(steps, run_tally)
        if steps:  # a run resumed at its end trained nothing to summarise
            self._call("on_log", logs=summary)
        if args.load_best_model_at_end and state.best_checkpoint:
            self._info(
                "loading the best checkpoint %s (%s %.6g)",
                state.best_checkpoint,
                args.metric_for_best_model,
                state.best_metric,
            )
            self.load_weights(Path(state.best_checkpoint))
            if self.ema is not None and args.eval_with_ema:  # its metric was the average's
                self.ema.load_state_dict(read_ema_component(Path(state.best_checkpoint)))
                self.ema.copy_to_weights()
        self._call("on_train_end")
        metrics = {
            **summary,
            "total_tokens": float(state.tokens_seen),
            "nonfinite_skipped": float(state.nonfinite_skipped),
            **self._last_eval[1],
        }
        return TrainOutput(state.global_step, run_tally.mean_loss, metrics)

    def _train_summary(self, steps: int, run_tally: Tally) -> dict[str, float]:
        """Hugging Face's end-of-training metrics for this ``train()`` call (a resumed run counts
        the steps and samples it ran itself): ``train_runtime`` (seconds, from the first step),
        ``train_samples_per_second`` (the items trained on, over ranks),
        ``train_steps_per_second``, ``total_flos`` (over the whole run, for a model that
        estimates them), ``train_loss`` and ``epoch``."""
        runtime = max(time.perf_counter() - run_tally.started, 1e-9)
        summary = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(run_tally.samples / runtime, 3),
            "train_steps_per_second": round(steps / runtime, 3),
        }
        if self._counts_flops:
            summary["total_flos"] = self.state.total_flos
        summary["train_loss"] = run_tally.mean_loss
        summary["epoch"] = self.state.epoch
        return summary

    # ------------------------------------------------------------------ one step (overridable)
    def forward_backward(self, window: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over one optimizer step's micro-batches; (mean loss, tokens)
        on this rank.

        Each micro-batch's loss is divided by the window's length, so a short last window
        averages over what it has (``window_loss``).
        """
        window = [self._to_device(batch) for batch in window]
        num_items = self.num_items_in_batch(window)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.long, device=self.device)
        for index, batch in enumerate(window):
            tokens += count_tokens(batch)
            with self.no_sync(last=index == len(window) - 1):
                with self.autocast():
                    loss = self.window_loss(batch, len(window), num_items)
                self.backward(loss)
            loss_sum += loss.detach().float()
        return loss_sum, tokens

    def window_loss(
        self, batch: Batch, window_size: int, num_items_in_batch: torch.Tensor | None
    ) -> torch.Tensor:
        """One micro-batch's share of the optimizer step's loss on this rank.

        A per-batch mean is divided by the window's length. A ``compute_loss_func`` loss
        normalised by ``num_items_in_batch`` already is the step's (the window's label tokens,
        over the ranks with ``average_tokens_across_devices``): it is multiplied by the
        data-parallel size instead, which DDP's gradient average takes back out (HF's rule).
        """
        if num_items_in_batch is None:
            return self._training_loss(batch) / window_size
        loss = self._training_loss(batch, num_items_in_batch=num_items_in_batch)
        return loss * self._items_ranks()

    def _training_loss(self, batch: Batch, **items: Any) -> torch.Tensor:
        """``compute_loss`` on the training model; the extra loss parts and metrics its outputs
        hold go to the log tally, on the device (``Tally.add_outputs``). A ``compute_loss``
        overridden without ``return_outputs`` gives the loss only."""
        if not takes_keyword(self.compute_loss, "return_outputs"):
            return self.compute_loss(self.wrapped_model, batch, **items)
        loss, outputs = self.compute_loss(self.wrapped_model, batch, return_outputs=True, **items)
        self._tally.add_outputs(outputs)
        return loss

    def _items_ranks(self) -> int:
        """The ranks whose label tokens ``num_items_in_batch`` counts."""
        return self.topology.dp_size if self.args.average_tokens_across_devices else 1

    def num_items_in_batch(
        self, window: list[Batch], *, over_ranks: bool = True
    ) -> torch.Tensor | None:
        """Hugging Face's ``num_items_in_batch`` for a ``compute_loss_func`` that takes it:
        the label tokens (not -100) of ``window``'s ``labels`` (``shift_labels`` where a batch
        has them; without each row's first label where the model's loss shifts them), summed
        over the data-parallel ranks with ``average_tokens_across_devices`` when
        ``over_ranks``. None otherwise, or when the labels are no tensors."""
        if not self._loss_func_takes_items or not window or "labels" not in window[0]:
            return None
        shifts = loss_shifts_labels(self.model)
        try:
            count = sum(
                (
                    batch["shift_labels"]
                    if "shift_labels" in batch
                    else batch["labels"][..., 1:]
                    if shifts
                    else batch["labels"]
                )
                .ne(IGNORE_INDEX)
                .sum()
                for batch in window
            )
        except (TypeError, AttributeError):
            return None
        if over_ranks and self._items_ranks() > 1:  # every rank steps through the same windows
            count = self.all_reduce_sum(count)
        return count

    def compute_loss(
        self,
        model: nn.Module,
        batch: Batch,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss of one batch, as Hugging Face's ``Trainer.compute_loss``.

        With ``compute_loss_func`` or ``label_smoothing_factor`` the batch's ``labels`` are
        taken out; the model gets the rest (and ``num_items_in_batch``, when the function
        takes it and the model accepts loss keywords). Then ``compute_loss_func(outputs,
        labels[, num_items_in_batch=])``, or the smoothed cross-entropy of the logits, or else
        the model's own ``.loss`` / ``["loss"]`` / first element of a tuple.
        ``return_outputs`` also returns the model's outputs (evaluation reads the logits).
        """
        func, smoother = self.compute_loss_func, self._label_smoother
        labels = None
        if loss_from_outputs(func, self.args.label_smoothing_factor):
            batch, labels = split_labels(batch)
        if num_items_in_batch is not None and accepts_loss_kwargs(model):
            batch = {**batch, "num_items_in_batch": num_items_in_batch}
        outputs = model(**batch)
        if func is not None:
            loss = self._call_loss_func(func, outputs, labels, num_items_in_batch)
        elif labels is not None:
            loss = smoother(outputs, labels, shift_labels=is_causal_lm(model))
        else:
            loss = model_loss(outputs, f"{type(unwrap_model(model)).__name__}.forward")
        return (loss, outputs) if return_outputs else loss

    def _call_loss_func(
        self, func: Callable[..., Any], outputs: Any, labels: Any, num_items: Any
    ) -> torch.Tensor:
        if labels is None and not self._warned_no_labels:
            self._warned_no_labels = True
            self._info(
                "compute_loss_func is called with labels=None: the batches have no 'labels' key",
                level=logging.WARNING,
            )
        if self._loss_func_takes_items:
            loss = func(outputs, labels, num_items_in_batch=num_items)
        else:
            loss = func(outputs, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            name = getattr(func, "__name__", None) or getattr(
                getattr(func, "func", None), "__name__", "compute_loss_func"
            )
            got = type(loss).__name__
            if isinstance(loss, torch.Tensor):
                got = f"a tensor of shape {tuple(loss.shape)}"
            raise ValueError(
                f"trainer.compute_loss_func ({name}) must return the loss, a tensor with one "
                f"value (got {got}); reduce it, e.g. with reduction='mean'"
            )
        return loss.reshape(())

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_gradients(self) -> torch.Tensor:
        """The total gradient norm before clipping; clips to ``max_grad_norm`` when set."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.args.max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, grad_norm)
        return grad_norm

    def reduce_step(
        self,
        loss: torch.Tensor,
        tokens: torch.Tensor,
        grad_norm: torch.Tensor,
        samples: float = 0,
        flops: float = 0.0,
    ) -> StepResult:
        """Agree on the step across ranks with one all-reduce of (loss, tokens, samples,
        flops); ``samples`` and ``flops`` are this rank's, known on the host.

        The summed loss is non-finite exactly when some rank's loss is, and gradients are
        already synchronised, so every rank takes the same skip decision. Everything stays on
        the device: nothing here waits for the step to finish.
        """
        counts = [loss.new_full((), value, dtype=torch.float64) for value in (samples, flops)]
        stats = self.all_reduce_sum(torch.stack([loss.double(), tokens.double(), *counts]))
        loss_sum, total_tokens, total_samples, total_flops = stats.unbind()
        finite = torch.isfinite(loss_sum)
        if self.scaler is None:  # with a grad scaler, overflowing gradients are its to skip
            finite = finite & torch.isfinite(grad_norm)
        return StepResult(
            loss_sum / self.topology.dp_size,
            total_tokens,
            grad_norm,
            finite,
            total_samples / self.topology.num_stages,  # every stage of a pipeline sees the batch
            total_flops,
        )

    def _count_work(self, window: list[Batch]) -> tuple[int, float]:
        """The items of this rank's micro-batches and their floating-point operations (0 for a
        model that gives no estimate), from the batches' shapes."""
        samples, flops = 0, 0.0
        for batch in window:
            samples += batch_size_of(batch)
            estimate = self.floating_point_ops(batch)
            if estimate is not None:
                flops += estimate
                self._counts_flops = True
        return samples, flops

    def floating_point_ops(self, batch: Batch) -> float | None:
        """One micro-batch's forward and backward floating-point operations on this rank, as
        Hugging Face's Trainer estimates them: the model's own ``floating_point_ops(batch)``
        where it has one (any model may define it), else for a model with ``num_parameters``
        (a ``PreTrainedModel``) 6 x the main input's tokens x the parameters outside the
        embeddings. None otherwise: ``total_flos`` is then left out of the summary. Override
        to count another way."""
        model = unwrap_model(self.model, through_adapters=True)
        estimate = getattr(model, "floating_point_ops", None)
        if callable(estimate):
            return float(estimate(batch))
        inputs = batch.get(getattr(model, "main_input_name", "input_ids"))
        if not callable(getattr(model, "num_parameters", None)) or not torch.is_tensor(inputs):
            return None
        return 6.0 * inputs.numel() * model.num_parameters(exclude_embeddings=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (every rank gets the result)."""
        return dist.all_reduce(tensor)

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _step_unless_nonfinite(self, step: StepResult) -> torch.Tensor | bool:
        """The optimizer step, skipped when ``step`` is non-finite and ``skip_nonfinite`` is on.

        An optimizer that takes torch's ``found_inf`` (the fused ones, as the default AdamW,
        which a grad scaler drives the same way) skips on the device. Any other needs the
        decision on the host, which waits for the step's gradients: one host sync per step.

        Returns whether the step was applied: True, or a bool tensor on the device where the
        decision was taken there (a grad scaler also skips steps whose gradients overflow).
        """
        self._copy_gate.wait_copied()  # an async save still copying what this step changes
        applied: torch.Tensor | bool = True
        if self.scaler is not None:  # its step skips gradients that are not finite
            applied = torch.isfinite(step.grad_norm)
        if not self.args.skip_nonfinite:
            self.optimizer_step()
            return applied
        optimizer = self._device_skippable_optimizer()
        if optimizer is not None:
            optimizer.grad_scale, optimizer.found_inf = None, (~step.finite).float()
            try:
                self.optimizer_step()  # a no-op when found_inf is 1, the step count included
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        elif step.finite:  # host sync
            self.optimizer_step()
        elif self.scaler is not None:
            self.scaler.update()
        return step.finite & applied

    def _optimizer_stepped(self, applied: torch.Tensor | bool) -> None:
        """``on_optimizer_step(applied=...)`` for the callbacks and checkpoint components that
        listen (an EMA updates only after an applied step). Reading a decision taken on the
        device waits for the step, so it is read only when something listens."""
        listeners = self._step_listeners
        if not listeners:
            return
        applied = bool(applied)  # host sync where the skip was decided on the device
        for listener in listeners:
            listener(applied=applied)

    def _device_skippable_optimizer(self) -> Optimizer | None:
        """The optimizer if it can skip its own step on the device, else None.

        Not with a grad scaler: its ``step`` sets ``found_inf`` itself.
        """
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
        if self.scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False):
            return optimizer
        return None

    def autocast(self) -> AbstractContextManager:
        """bf16 / fp16 autocast for the forward pass when requested."""
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        return torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext()

    def no_sync(self, last: bool) -> AbstractContextManager:
        """Skip gradient synchronisation on all but the last micro-batch (DDP overrides)."""
        return nullcontext()

    def eval_forwards(self, count: int) -> int:
        """How many evaluation forwards this rank runs when it has ``count`` batches: more
        where a forward is collective (sharded parameters), so every rank takes part."""
        return count

    def distributed(self) -> AbstractContextManager:
        """The process group for a torchrun job (created here if needed, then destroyed)."""
        args = self.args
        return dist.process_group(self.topology, self.device, args.ddp_backend, args.ddp_timeout)

    def _agree_max(self, value: float) -> float:
        if not self.topology.distributed:
            return value
        return dist.all_reduce(torch.tensor([float(value)], device=self.device), "max").item()

    # ------------------------------------------------------------------ setup
    def _setup_training(self) -> None:
        args = self.args
        apply_runtime_settings(args, self.topology.is_main)
        set_seed(args.seed)
        self.checkpoint_registry, self._early_components = None, []
        self.ema = None
        self.wrapped_model = self.transform_model()
        if self.topology.distributed:
            set_seed(args.seed + self.topology.rank)  # same weights, each rank its own dropout
        self.train_loader = self.build_train_loader()
        steps_per_epoch = math.ceil(len(self.train_loader) / args.gradient_accumulation_steps)
        if args.max_steps > 0:
            self.max_steps = args.max_steps
            self.num_epochs = math.ceil(args.max_steps / steps_per_epoch)
        else:
            self.max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
            self.num_epochs = math.ceil(args.num_train_epochs)
        self._every = Intervals.of(args, self.max_steps)
        self.setup_optimizer()
        self.lr_scheduler = build_scheduler(
            self.lr_scheduler_factory, self.optimizer, args, self.max_steps
        )
        self.state = TrainerState(
            max_steps=self.max_steps,
            num_train_epochs=self.num_epochs,
            is_world_process_zero=self.is_main_process,
        )
        self.control = TrainerControl()
        self.data_position = DataPosition(self.train_loader, is_main=self.is_main_process)
        self._tally = Tally()
        self._last_eval, self._last_save_step = (None, {}), None
        self.build_checkpoint_registry()
        self._setup_async_save()

    def _setup_async_save(self) -> None:
        """``async_save``: pinned staging buffers on CUDA, and a gloo group of every rank for
        the background commit's meetings (created here, by every rank, in the same order)."""
        self._commits, self._copy_gate = BackgroundCommit(), HostCopier()
        self._staging, self._commit_group = None, None
        if not self.args.async_save:
            return
        if self.device.type == "cuda":
            self._staging = HostStaging()
        if self.topology.distributed and torch.distributed.is_initialized():
            self._commit_group = torch.distributed.new_group(backend="gloo")

    def setup_optimizer(self) -> None:
        """The optimizer over the model's parameters, and the grad scaler (fp16); the
        learning-rate schedule is built by the loop afterwards, on ``optimizer``."""
        self.optimizer = build_optimizer(self.optimizer_factory, self.model, self.args)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.args.fp16 else None

    # ------------------------------------------------------------------ the model-transform stage
    def transform_model(self) -> nn.Module:
        """Everything that happens to the model between "built" and "trained", in this order
        (forge/train/transforms.py): build (``build_model``, just after seeding) -> the model's
        settings (``use_cache``, loss type) -> adapters (``apply_adapters``) -> placement on the
        device -> activation checkpointing -> ``torch.compile`` -> the trainer's parallel wrap
        (``parallelize``, the one step a trainer overrides).

        Sets ``model`` (the module checkpoints hold and the optimizer steps) and returns what
        the training step calls.
        """
        args = self.args
        model = self.build_model()
        apply_model_settings(model, args)
        model = self.apply_adapters(model)
        model.to(self.device)
        self.model = model
        done = apply_activation_checkpointing(model, args, **self.activation_checkpointing_scope())
        if done:
            self._info("%s", done)
        compiled = self.compile_model(model) if args.torch_compile else None
        self._eval_model = compiled
        return self.parallelize(model if compiled is None else compiled)

    def build_model(self) -> nn.Module:
        """This rank's model: ``model_init()``, called just after seeding, or the module the
        trainer was given (a pipeline stage builds only its own part)."""
        return self._call_model_init() if self.model_init is not None else self.model

    def _call_model_init(self) -> nn.Module:
        model = self.model_init()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"trainer.model built a {type(model).__name__}, not an nn.Module; pass a module "
                "or a callable (e.g. !partial) that returns one"
            )
        return model

    def apply_adapters(self, model: nn.Module) -> nn.Module:
        """The adapter step: with ``peft_config``, the model wrapped by peft (LoRA; its base
        frozen, forge/train/lora.py), else the model as built. In ``train()`` the run records
        its frozen base first (once; a resume checks it is unchanged)."""
        if self.peft_config is None:
            return model
        from forge.train.lora import apply_lora, lora_config_for

        config = lora_config_for(model, self.peft_config)  # bad targets: refused before any write
        if self._in_train:
            self._lora_base = self._record_lora_base(model)
        return apply_lora(model, config)

    def _record_lora_base(self, model: nn.Module) -> dict[str, Any]:
        """Rank 0 records (or, resuming, checks) the run's base; every rank gets the record,
        or the refusal."""
        from forge.train.lora import LoraUsageError, record_base

        record, error = None, None
        if self.is_main_process:
            try:
                record = record_base(model, self.args.output_dir)
            except (CheckpointError, LoraUsageError) as exc:
                error = exc
        record, error = dist.broadcast_object((record, error))
        if error is not None:
            raise error
        return record

    def activation_checkpointing_scope(self) -> dict[str, Any]:
        """Where activation checkpointing finds the blocks, as keywords of
        ``apply_activation_checkpointing``: the whole model here; a pipeline stage names its
        layers and holds only some of the named blocks."""
        return {}

    def compile_model(self, model: nn.Module) -> nn.Module:
        """``torch.compile`` with ``torch_compile_backend`` / ``torch_compile_mode``."""
        args = self.args
        return torch.compile(
            model, backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode
        )

    def parallelize(self, model: nn.Module) -> nn.Module:
        """The trainer's parallel wrap, the transform stage's last step: what the training step
        calls (``model``, compiled when ``torch_compile`` is on). One process: no wrapper."""
        return model

    def evaluation_model(self) -> nn.Module:
        """What evaluation calls: the model, compiled when ``torch_compile`` is on.

        Not the parallel wrapper: evaluation needs no gradient synchronisation. In ``train()``
        it is the module the transform stage compiled (the one the wrapper calls).
        """
        if not self.args.torch_compile:
            return self.model
        if self._eval_model is None:  # outside train()
            self._eval_model = self.compile_model(self.model)
        return self._eval_model

    def release_wrappers(self) -> None:
        """Drop the training wrappers at the end of ``train()``.

        A DDP wrapper holds the process group; freed later (at interpreter exit) the group's
        destructor can deadlock with its worker thread, so it goes while the group is alive.
        """
        self.wrapped_model = self._eval_model = None
        if self.topology.distributed:
            gc.collect()  # wrappers sit in reference cycles (hooks)

    def per_rank_batch_size(self, field: str) -> int:
        """The batch one rank loads, from the ``args`` field that sets it."""
        return getattr(self.args, field)

    def build_train_loader(self) -> Any:
        """This data-parallel rank's resumable loader over the training dataset."""
        args = self.args
        return trainer_loaders.build_train_loader(
            self.train_dataset,
            self.data_collator,
            batch_size=self.per_rank_batch_size("per_device_train_batch_size"),
            seed=args.seed if args.data_seed is None else args.data_seed,
            rank=self.topology.dp_rank,
            world_size=self.topology.dp_size,
            shuffle=args.train_sampling_strategy == "random",
            drop_last=args.dataloader_drop_last,
            workers=self._worker_settings(),
            inputs=self._model_inputs(),
        )

    def build_eval_loader(self, dataset: Dataset | None = None, description: str = "eval") -> Any:
        """This rank's share of ``dataset`` (default: the eval dataset), in order: items
        ``rank, rank + world_size, ...``, each item once."""
        return trainer_loaders.build_eval_loader(
            self.eval_dataset if dataset is None else dataset,
            self.data_collator,
            batch_size=self.per_rank_batch_size("per_device_eval_batch_size"),
            rank=self.topology.dp_rank,
            world_size=self.topology.dp_size,
            workers=self._worker_settings(),
            inputs=self._model_inputs(),
            description=description,
        )

    def _worker_settings(self) -> dict[str, Any]:
        args = self.args
        return trainer_loaders.worker_settings(
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and self.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
        )

    def _model_inputs(self) -> ModelInputs | None:
        """What ``remove_unused_columns`` keeps (None: keep every column)."""
        if not self.args.remove_unused_columns:
            return None
        return ModelInputs.of(unwrap_model(self.model, through_adapters=True), self.label_names)

    @property
    def label_names(self) -> list[str]:
        """``args.label_names``, else the model's ``forward`` parameters named like labels;
        with ``compute_loss_func`` and none of those, ``labels`` (what the function gets)."""
        return resolve_label_names(
            self.args.label_names, self.model, self.compute_loss_func is not None
        )

    def _check_eval_dataset(self) -> None:
        if self.eval_dataset is not None:
            return
        args = self.args
        needs = [
            name
            for name, on in (
                ("eval_strategy", args.eval_strategy != "no"),
                ("load_best_model_at_end", args.load_best_model_at_end),
                ("early_stopping_patience", args.early_stopping_patience is not None),
            )
            if on
        ]
        if needs:
            raise TrainingArgumentsError(
                [
                    f"trainer.eval_dataset is required by {args.config_key}.{name}; pass an "
                    + (
                        'eval dataset or set eval_strategy: "no"'
                        if name == "eval_strategy"
                        else f"eval dataset or unset {name}"
                    )
                    for name in needs
                ]
            )

    # ------------------------------------------------------------------ checkpoints
    def register(self, component: Component) -> None:
        """Add a checkpoint component: the one way trainers (``register_components``),
        callbacks (``on_register``) and model transforms add state to every checkpoint. It is
        saved and restored in registration order, random generators last.

        The model-transform stage runs before the optimizer exists: what it registers joins
        the registry when ``train()`` builds it, after the model and optimizer."""
        if self.checkpoint_registry is None:
            self._early_components.append(component)
        else:
            self.checkpoint_registry.register(component)

    def build_checkpoint_registry(self) -> CheckpointRegistry:
        """A fresh registry of this trainer's components (``train()`` builds it once, after
        the model, optimizer and scheduler, before a checkpoint is loaded)."""
        self.checkpoint_registry = CheckpointRegistry(self.topology)
        self.register_components()
        registered = [c.obj for c in self.checkpoint_registry.components.values()]
        self.callback_handler.keep_apart(registered)
        listeners = [
            obj.on_optimizer_step
            for obj in registered
            if callable(getattr(obj, "on_optimizer_step", None))
            and not any(obj is cb for cb in self.callback_handler.callbacks)  # called as one
        ]
        if self.callback_handler.listens("on_optimizer_step"):
            listeners.append(functools.partial(self._call, "on_optimizer_step"))
        self._step_listeners = listeners
        return self.checkpoint_registry

    def register_components(self) -> None:
        """Register what a checkpoint of this trainer holds: model, optimizer, scheduler,
        scaler, the loop's counters, the callbacks' shared state, what the model-transform
        stage and the callbacks (``on_register``) register, data position and random
        generators.

        Override ``model_component`` / ``optimizer_component`` to change how the weights or
        the optimizer are saved; override this (call super(), then ``self.register``) to add a
        part.
        """
        args, key = self.args, self.args.config_key
        self.register(self.model_component())
        self.register(self.optimizer_component())
        if args.ema_decay is not None:
            self.register(self.ema_component())
        self.register(
            Component(
                "lr_scheduler",
                self.lr_scheduler,
                save=args.save_scheduler_state,
                restore=args.restore_scheduler_state,
                fix=_start_fresh(key, "restore_scheduler_state"),
            )
        )
        if self.scaler is not None:
            self.register(Component("scaler", self.scaler, required=False))
        self.register(Component("trainer", self))
        self.register(Component("callbacks", self.callback_handler))
        early, self._early_components = self._early_components, []
        for component in early:  # the model-transform stage's
            self.register(component)
        self._call("on_register", register=self.register, topology=self.topology)
        data = self.data_position
        self.register(
            Component(
                "data",
                data,
                Scope.RANK,
                save=args.save_dataloader_state,
                restore=args.restore_dataloader_state,
                fix=f"set {key}.restore_dataloader_state: false to restart the epoch",
                on_reshape=data.on_reshape,
            )
        )
        self.register(
            Component(
                "rng",
                RngState(self.device),
                Scope.RANK,
                save=args.save_rng_state,
                restore=args.restore_rng_state,
                restore_last=True,
                fix=_start_fresh(key, "restore_rng_state"),
                on_reshape=lambda _: None,  # data's warning says it
            )
        )

    def model_component(self) -> Component:
        """The model's weights (stage-scoped, written as safetensors); of a LoRA model only
        the adapter, in peft's layout (forge/checkpoint/adapter.py)."""
        if is_peft_model(self.model):
            weights = AdapterWeights(self.model, self.tokenizer, base=self._lora_base)
            return Component("model", weights, Scope.STAGE, weights=True)
        return Component(
            "model", ModelWeights(self.model, self.tokenizer), Scope.STAGE, weights=True
        )

    def optimizer_component(self) -> Component:
        """The optimizer's state, keyed by parameter name (stage-scoped)."""
        args = self.args
        return Component(
            "optimizer",
            OptimizerState(self.model, self.optimizer),
            Scope.STAGE,
            save=args.save_optimizer_state,
            restore=args.restore_optimizer_state,
            fix=_start_fresh(args.config_key, "restore_optimizer_state"),
        )

    def ema_component(self) -> Component:
        """The moving average of the trainable parameters (``ema_decay``; forge/train/ema.py):
        stage-scoped and keyed by parameter name, so each pipeline stage keeps its own and a
        checkpoint of one split loads into another. A checkpoint without one (trained without
        ``ema_decay``) starts it from the restored weights, with a warning."""
        args = self.args
        self.ema = WeightsEMA(
            self.model,
            args.ema_decay,
            warmup_steps=args.ema_warmup_steps,
            update_every=args.ema_update_every,
        )
        return Component(
            EMA_COMPONENT, self.ema, Scope.STAGE, required=False, reshard=WeightsEMA.reshard
        )

    def evaluation_weights(self) -> AbstractContextManager:
        """The weights evaluation runs with: with ``eval_with_ema``, the moving average,
        swapped into the model for the evaluation and out again (bit for bit) after it."""
        if self.args.eval_with_ema and self.ema is not None:
            return self.ema.swapped_in()
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """The loop's own counters: a checkpoint component like any other."""
        self._settle()
        return {
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "position": {"epoch": self.data_position.epoch, "batch": self.data_position.batch},
            "trainer_state": {**self.state.state_dict(), **self._saving},
            "log_tally": self._tally.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.state
        state.global_step = int(saved["global_step"])
        state.epoch = float(saved["epoch"])
        state.load_state_dict(saved.get("trainer_state", {}))
        self._tally.load_state_dict(saved.get("log_tally", {}))
        position = saved["position"]
        self.data_position.seek(int(position["epoch"]), int(position["batch"]))

    def save_checkpoint(self) -> Path:
        """Save the current step (every rank calls this) in two phases, then act on it.

        ``snapshot_checkpoint`` copies every component's state to host memory (training
        thread), ``commit_checkpoint`` writes the copy and renames it into place, and only
        then ``_on_commit`` records it as the last (and perhaps best) checkpoint, rotates old
        ones and calls ``on_save`` (which updates ``run.json``): a save that fails or is killed
        before its rename changes none of them.

        With ``async_save`` the loop waits only for the snapshot: the commit runs on a
        background thread (forge/checkpoint/background.py) and ``_on_commit`` back in the
        training thread once it ended (``_finish_commit``, or the next wait); the path returned
        is where the checkpoint will be once committed. Either way a save first waits for the
        previous one, whose outcome (last and best checkpoint) this one builds on.
        """
        self.wait_for_checkpoint()
        state = self.state
        step = state.global_step
        if self._last_save_step == step and state.last_checkpoint:
            return Path(state.last_checkpoint)  # already saved at this step
        metrics = self._last_eval[1] if self._last_eval[0] == step else {}
        recorded = self._recorded_by(self.checkpoints_dir / checkpoint_name(step), metrics)
        copier = self._host_copier()
        snapshot = self.snapshot_checkpoint(recorded, metrics, copier)
        if not self.args.async_save:
            final = self.commit_checkpoint(snapshot)
            self._on_commit(snapshot, final, recorded)
            return final

        final = self.checkpoints_dir / checkpoint_name(step)

        def commit() -> None:
            copier.copy_deferred()  # first, while the loop runs the next forward and backward
            self.commit_checkpoint(snapshot, any_failed=self._commit_any_failed)

        def then() -> None:  # back in the training thread (BackgroundCommit.poll / wait)
            self._on_commit(snapshot, final, recorded)

        self._commits.submit(commit, checkpoint_name(step), then=then)
        self._copy_gate = copier  # the next optimizer step waits for the deferred copies
        return final

    def _host_copier(self) -> HostCopier:
        """How this save's snapshot copies tensors (forge/checkpoint/snapshot.py). A synchronous
        commit ends before the next optimizer step: CPU state needs no copy. An async one must
        copy (the optimizer steps change parameters and moments in place before the commit
        ends), but the parameters and the optimizer's state change only in the optimizer step:
        their copies run on the commit thread, while the loop computes the next step's forward
        and backward, and the next optimizer step waits for them."""
        if not self.args.async_save:
            return HostCopier(copy_cpu=False)
        if self._staging is not None:
            self._staging.reuse()  # the previous commit is done: its buffers are free
        return HostCopier(staging=self._staging, deferrable=stepped_by(self.optimizer))

    def wait_for_checkpoint(self) -> None:
        """Block until no checkpoint commit is in flight (``async_save``); raise its failure."""
        self._commits.wait()

    def snapshot_checkpoint(
        self, recorded: dict[str, Any], metrics: dict[str, float], copier: HostCopier | None = None
    ) -> CheckpointSnapshot:
        """Phase 1, every rank, in the training thread: every component's state copied to host
        memory (nothing is written). The trainer's own counters in it carry ``recorded``
        without the live state taking them."""
        self._saving = recorded
        try:
            snapshot = self.checkpoint_registry.snapshot(self.state.global_step, copier)
        finally:
            self._saving = {}
        snapshot.epoch, snapshot.metrics = self.state.epoch, dict(metrics)
        return snapshot

    def commit_checkpoint(
        self, snapshot: CheckpointSnapshot, any_failed: Callable[[bool], bool] | None = None
    ) -> Path:
        """Phase 2: write ``snapshot`` as a checkpoint (files, hashes, fsync, manifest, rename).

        It reads nothing of the live trainer or model but the model's config and the tokenizer
        (written beside the weights), so it could run outside the training thread. Its only collectives are the writer's three meetings
        (``any_failed``, an all-reduce of "did this rank fail": after rank 0 creates the
        temporary directory, after every rank has written, after rank 0's rename); when it
        returns, every rank knows the checkpoint is in place. A background commit passes
        ``any_failed`` over its own process group, so its meetings never interleave with the
        training thread's collectives.
        """
        if any_failed is None and self.topology.distributed:
            any_failed = self._any_rank_failed
        with CheckpointWriter(
            self.checkpoints_dir,
            snapshot.step,
            rank=self.topology.rank,
            world_size=self.topology.world_size,
            any_failed=any_failed,
            trainer=self.trainer_kind,
            hash_algorithm=self.args.checkpoint_hash,
        ) as writer:
            snapshot.write(writer)
        return writer.final_path

    def _on_commit(
        self, snapshot: CheckpointSnapshot, final: Path, recorded: dict[str, Any]
    ) -> None:
        """Phase 3, every rank, after the checkpoint's rename: the loop's state takes what the
        checkpoint recorded; rank 0 rotates old checkpoints (never the best); ``on_save``.

        Callbacks see the state as it was at the snapshot (its step and epoch), not the live
        one, which an async commit's loop has moved on from."""
        args, state = self.args, self.state
        for name, value in recorded.items():
            setattr(state, name, value)
        self._last_save_step = snapshot.step
        if self.is_main_process and args.save_total_limit:
            protect = [state.best_checkpoint] if state.best_checkpoint else []
            rotate_checkpoints(self.checkpoints_dir, args.save_total_limit, protect=protect)
        saved = copy.copy(state)
        saved.global_step, saved.epoch = snapshot.step, snapshot.epoch
        self._call("on_save", state=saved, checkpoint_path=final, metrics=snapshot.metrics)

    def _any_rank_failed(self, failed: bool) -> bool:
        return bool(self._agree_max(1.0 if failed else 0.0))

    def _commit_any_failed(self, failed: bool) -> bool:
        """The background commit's meeting: over its own gloo group, on host tensors."""
        if self._commit_group is None:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0])
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MAX, group=self._commit_group
        )
        return bool(flag.item())

    def _recorded_by(self, checkpoint: Path, metrics: dict[str, float]) -> dict[str, Any]:
        """What saving ``checkpoint`` changes in the loop's state: it becomes the last
        checkpoint, and the best one when ``metrics`` improve ``metric_for_best_model``."""
        args, state = self.args, self.state
        recorded: dict[str, Any] = {"last_checkpoint": str(checkpoint)}
        value = metrics.get(args.metric_for_best_model or "")
        if value is None or not math.isfinite(value):
            return recorded
        best = state.best_metric
        better = best is None or (value > best if args.greater_is_better else value < best)
        if better:
            recorded.update(best_metric=float(value), best_checkpoint=str(checkpoint))
        return recorded

    def load_weights(self, checkpoint: str | os.PathLike) -> None:
        """Load a checkpoint's model weights, building the model first (``model_init``,
        seeded) if need be: the model ``evaluate()`` / ``predict()`` then use, or the best one
        at the end of training. A pipeline stage builds and loads only its own part."""
        if self.model is None:
            set_seed(self.args.seed)
            self.model = self.build_model()
        if self.peft_config is not None and not is_peft_model(self.model):
            self.model = self.apply_adapters(self.model)  # its checkpoints hold the adapter
        load_model_weights(self.model, Path(checkpoint), strict=True)

    def _resolve_checkpoint(
        self, resume: bool | str | os.PathLike | Checkpoint | None
    ) -> Checkpoint | None:
        """The checkpoint to resume from, found (and validated, once) on rank 0 and shared
        with every rank."""
        if resume is False or resume is None:
            return None
        found, error = None, None
        if self.is_main_process:
            try:
                found = resume_checkpoint(resume, self.args.output_dir)
            except CheckpointError as exc:
                error = str(exc)
        found, error = dist.broadcast_object((found, error))
        if error is not None:
            raise CheckpointError(error)
        return found

    def _load_checkpoint(self, path: Path) -> None:
        """Restore every component; the random generators go last, so nothing draws from
        them between the restore and the first resumed step."""
        manifest = self.checkpoint_registry.load(path)
        state = self.state
        state.resumed_from = str(path)
        if manifest.metrics:
            self._last_eval = (state.global_step, dict(manifest.metrics))
        self._last_save_step = state.global_step
        self.data_position.restart_epoch_unless_restored()
        if self.ema is not None:
            self.ema.reset_unless_restored()

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        eval_dataset: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` metrics over ``eval_dataset`` (default: the trainer's),
        each prefixed ``{metric_key_prefix}_``, reported to the callbacks (``on_evaluate``).

        The loss is the mean over samples (over label tokens for token-level labels), reduced
        over ranks; a causal LM also gets ``eval_perplexity``. A dict of datasets is evaluated
        one by one, each one's metrics prefixed ``eval_NAME_`` (as HF's Trainer does).
        Evaluation forks the random generators, so it never changes the training trajectory.
        The work is the ``Evaluator``'s (forge/train/evaluator.py).
        """
        metrics = self.evaluator.evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if self._in_train:
            if self.args.metric_for_best_model:
                # the best metric so far is the one the save in flight records: an async
                # commit must have given it to the state before this evaluation is judged
                self.wait_for_checkpoint()
            metrics["epoch"] = self.state.epoch
            self.evaluator.check_best_metric(metrics)
        self._last_eval = (self.state.global_step, metrics)
        self._call("on_evaluate", metrics=metrics)
        return metrics

    def predict(
        self,
        test_dataset: Dataset,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """Predictions (and, where the dataset has labels, labels and metrics) over
        ``test_dataset``: a ``transformers.trainer_utils.PredictionOutput``."""
        return self.evaluator.predict(test_dataset, ignore_keys, metric_key_prefix)

    def evaluation_loop(
        self,
        dataset: Dataset,
        description: str = "eval",
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """This rank's share of ``dataset`` through the model, gathered over the ranks: a
        ``transformers.trainer_utils.EvalLoopOutput``, as HF's ``Trainer.evaluation_loop``."""
        return self.evaluator.evaluation_loop(
            dataset, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )

    def prediction_step(
        self,
        model: nn.Module,
        batch: Batch,
        prediction_loss_only: bool,
        ignore_keys: list[str],
        label_names: list[str],
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """One evaluation batch: (mean loss or None, logits or None, labels or None)."""
        return self.evaluator.prediction_step(
            model, batch, prediction_loss_only, ignore_keys, label_names
        )

    def forward_eval(
        self, model: nn.Module, batch: Batch, labels: Any
    ) -> tuple[torch.Tensor | None, Any]:
        """One evaluation batch's mean loss on this rank (None when there is none) and the
        model's outputs, from which the predictions are read (the evaluator's seam; a trainer
        that gives no outputs sets ``forward_eval_outputs = False``).

        With labels the loss is ``compute_loss``'s (``compute_loss_func`` and label smoothing
        included); without, a loss the model returns still counts.
        """
        with self.autocast():
            if labels is not None:
                num_items = self.num_items_in_batch([batch], over_ranks=False)
                items = {} if num_items is None else {"num_items_in_batch": num_items}
                loss, outputs = self.compute_loss(model, batch, return_outputs=True, **items)
                return loss.detach().mean(), outputs
            outputs = model(**batch)
        found = getattr(outputs, "loss", None)
        if found is None and isinstance(outputs, Mapping):
            found = outputs.get("loss")
        return (found.detach().mean() if isinstance(found, torch.Tensor) else None), outputs

    def _evaluation_enabled(self) -> bool:
        return self.eval_dataset is not None and self.args.eval_strategy != "no"

    def _evaluate_in_training(self, *, start: bool = False) -> bool:
        """Evaluate (unless this step already was), check ``metric_for_best_model`` against
        what the evaluation produced, step a metric-driven schedule; True when the metric
        improved on the best checkpoint's."""
        args, state = self.args, self.state
        if self._last_eval[0] == state.global_step and not start:
            return False
        metrics = self.evaluate()
        metric = args.metric_for_best_model
        if metric is None or start:
            return False
        value = metrics[metric]  # evaluate() checked it is there
        if isinstance(self.lr_scheduler, MetricSchedule):
            self.lr_scheduler.step(value)
        best = state.best_metric
        if not math.isfinite(value):
            return False
        return best is None or (value > best if args.greater_is_better else value < best)

    # ------------------------------------------------------------------ logging
    def log_step(self) -> None:
        """Report the steps since the last log: mean loss, the model's extra metrics (each
        float or 0-d tensor field of its outputs: ``model_metrics``), lr, grad norm, tokens/s
        (when the batches hold tokens: ``count_tokens``), epoch, peak memory (``peak_memory``)."""
        self._settle()
        tally, state = self._tally, self.state
        logs: dict[str, float] = {
            "loss": tally.mean_loss,
            **tally.metric_means(),  # the model's own (ponder cost, ...): means over the window
            "learning_rate": current_lr(self.lr_scheduler),
            "grad_norm": tally.grad_norm,
        }
        if tally.tokens:  # a model without input_ids or attention_mask has no tokens to rate
            logs["tokens_per_second"] = tally.tokens_per_second
        logs["epoch"] = round(state.epoch, 4)
        if tally.skipped:
            logs["nonfinite_skipped"] = state.nonfinite_skipped
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = state.tokens_seen
        logs.update(peak_memory(self.device))
        self._tally = Tally()
        self._call("on_log", logs=logs)

    def _log_start(self) -> None:
        args, state = self.args, self.state
        batch = self.per_rank_batch_size("per_device_train_batch_size")
        if args.skip_nonfinite and self._device_skippable_optimizer() is None:
            self._info(
                "skip_nonfinite with %s%s: each step waits for its gradients on the host to "
                "decide the skip; a fused optimizer (the default AdamW) decides on the device",
                type(getattr(self.optimizer, "optimizer", self.optimizer)).__name__,
                " and a grad scaler" if self.scaler is not None else "",
            )
        self._info(
            "training for %d steps (%d epochs of %d batches per rank); batch %d x accumulation "
            "%d x data-parallel %d = %d sequences per step",
            self.max_steps,
            self.num_epochs,
            len(self.train_loader),
            batch,
            args.gradient_accumulation_steps,
            self.topology.dp_size,
            batch * args.gradient_accumulation_steps * self.topology.dp_size,
        )
        if state.resumed_from:
            self._info("resumed from %s at step %d", state.resumed_from, state.global_step)

    def _info(self, message: str, *values: Any, level: int = logging.INFO) -> None:
        """Log on rank 0 only (every rank agrees on what is logged here)."""
        if self.is_main_process:
            logger.log(level, message, *values)

    def _call(self, event: str, *, state: TrainerState | None = None, **kwargs: Any) -> None:
        """Run a callback hook; hooks also get the model, optimizer and scheduler (as HF's).
        ``state``: what the hook sees instead of the live state (a save's, at its snapshot)."""
        self.callback_handler.call(
            event,
            self.args,
            state if state is not None else self.state,
            self.control,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            **kwargs,
        )

    # ------------------------------------------------------------------ helpers
    def _to_device(self, batch: Batch) -> Batch:
        if not isinstance(batch, Mapping):
            raise TypeError(not_a_dict_batch(batch, self.model))
        return {
            k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }


def _start_fresh(key: str, flag: str) -> str:
    return f"set {key}.{flag}: false to start it fresh"
