"""The training loop every forge trainer shares.

``BaseTrainer.train`` reads top to bottom: batch, forward, backward, clip, step, log, evaluate,
save, stop. It is composed of parts that each live in a file of their own:

- a parallelism strategy (forge/train/strategies/): how the model is wrapped (the last step of
  the model-transform stage), how one optimizer step's micro-batches run, how gradients are
  clipped and numbers summed over the ranks, how the weights and optimizer state are saved.
  ``Trainer``, ``AccelTrainer`` and ``PipelineTrainer`` (forge/train/trainers.py) are this loop
  with one strategy each (``make_strategy``);
- a checkpoint manager (forge/checkpoint/manager.py): the loop calls ``save`` where it saves,
  ``poll`` at each step boundary, ``before_optimizer_step`` and ``wait``, nothing else of it;
- the loss (forge/train/loss.py), evaluation (forge/train/evaluation.py, whose HF entry points
  ``evaluate`` / ``predict`` / ``evaluation_loop`` / ``prediction_step`` this class has);
- callbacks (forge/train/callbacks.py) with the seams features use: ``on_register`` adds
  checkpoint state, ``on_optimizer_step`` follows the optimizer, ``evaluation_weights`` chooses
  the weights evaluation runs with (a moving average of the weights is one such callback:
  forge/train/ema.py);
- the model-transform stage (``transform_model``, forge/train/transforms.py): build,
  adapters, activation checkpointing, compile, the strategy's wrap.

Resume is exact: every piece of state a step reads (weights, optimizer, scheduler, grad
scaler, step counters, callback state, data position, random generators) is a checkpoint
component, saved at a step boundary and restored before the first resumed step in
registration order, random generators last.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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
    Component,
    unwrap_model,
)
from forge.checkpoint.manager import CheckpointManager
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.batch_finder import MicroBatchSize
from forge.train.callbacks import CallbackHandler, TrainerCallback, TrainerControl, TrainerState
from forge.train.checks import check_callbacks, check_eval_dataset, check_trainer_arguments
from forge.train.data_position import DataPosition
from forge.train.evaluation import Evaluation
from forge.train.loop_state import (
    Batch,
    StepResult,
    StopVote,
    Tally,
    TrainOutput,
    step_logs,
    train_summary,
)
from forge.train.loss import TrainingLoss, batch_size_of, takes_keyword
from forge.train.memory import peak_memory
from forge.train.model_parts import ModelParts
from forge.train.optim import MetricSchedule, current_lr
from forge.train.packing import sequence_count
from forge.train.precision import numerics
from forge.train.rollback import RollBack, can_roll_back, roll_back
from forge.train.runtime import Intervals
from forge.train.setup import TrainerSetup
from forge.train.signals import StopSignals, TrainingInterrupted
from forge.train.standard_callbacks import default_callbacks
from forge.train.strategies.base import ParallelStrategy
from forge.train.topology import Topology
from forge.train.transforms import (
    activation_checkpointing_problems,
    adapter_step,
)

logger = logging.getLogger(__name__)


class BaseTrainer(TrainerSetup, Evaluation):
    """The shared loop; see the module docstring. A trainer sets ``trainer_kind`` and its
    strategy (``make_strategy``); the arguments are Hugging Face ``Trainer``'s.

    ``model`` is an ``nn.Module`` or a zero-argument callable that builds one (HF's
    ``model_init``), called after ``set_seed(args.seed)`` at the start of every ``train()``, so a
    resumed run rebuilds the same model. ``optimizer`` is None (AdamW from ``args``) or a
    callable taking the trainable parameters; ``lr_scheduler`` None (``lr_scheduler_type``) or a
    callable taking ``(optimizer, num_training_steps)``. Datasets are map-style and yield dicts
    (tuples: ``forge.data.TupleCollator`` names their parts). The loss is the model's own
    (``.loss``; ``forge.train.LossAdapter`` for a model that returns a bare tensor) or what
    ``compute_loss_func(outputs, labels[, num_items_in_batch])`` computes (forge/train/loss.py).
    ``compute_metrics`` and ``preprocess_logits_for_metrics`` are HF's (forge/train/
    evaluation.py). A ``tokenizer`` (HF 5's ``processing_class``) is saved into every
    checkpoint. ``peft_config`` (as TRL's trainers take it) is the transform stage's adapter
    step (forge/train/lora.py).
    """

    trainer_kind: ClassVar[str] = "base"
    #: constructor arguments a trainer cannot honour, with the reason and what to use instead
    unsupported_arguments: ClassVar[dict[str, str]] = {}

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
        check_trainer_arguments(
            model,
            args,
            self.unsupported_arguments,
            tokenizer=tokenizer,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            compute_loss_func=compute_loss_func,
            peft_config=peft_config,
        )
        self.args = args
        self.peft_config = peft_config
        self.adapter = adapter_step(peft_config)  # the transform stage's adapter step, if any
        self.model_init = None if isinstance(model, nn.Module) else model
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = data_collator
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.compute_loss_func = compute_loss_func
        self.loss = TrainingLoss(compute_loss_func, args, warn=self._info)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.topology = self.make_topology()
        device = self._resolve_device()
        check_eval_dataset(args, eval_dataset)
        if self.model is not None:  # a builder's model is checked when it is built
            problems = activation_checkpointing_problems(self.model, args)
            if problems:
                raise TrainingArgumentsError(problems)
        self.strategy = self.make_strategy(device)

        self.state = TrainerState(is_world_process_zero=self.topology.is_main)
        self.control = TrainerControl()
        self.micro_batches = MicroBatchSize(args, self.state, self.topology)  # auto_find_batch_size
        user_callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks]
        check_callbacks(args, eval_dataset, user_callbacks)
        self.callback_handler = CallbackHandler(
            default_callbacks(args, self.topology.is_main, user_callbacks) + user_callbacks
        )
        self.init_evaluation()

        # built by train()
        self.wrapped_model: nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self.lr_scheduler: LRScheduler | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.model_parts = ModelParts()  # what the model brings (forge/train/model_parts.py)
        self.train_loader: Any = None
        self.max_steps = 0
        self.num_epochs = 0
        self.data_position = DataPosition()  # where the loop is in the data
        self.checkpoints: CheckpointManager | None = None
        self._pending_components: list[Component] = []  # registered before the manager exists
        self._step_listeners: list[Callable[..., None]] = []  # their on_optimizer_step
        # several ranks agree on a signal in the steps' all-reduce (see _should_stop)
        self._signals = StopSignals(
            "one of the next two steps" if self.topology.distributed else "the next step"
        )
        self._stop_vote, self._stop_agreed = StopVote(), 0
        self._tally = Tally()
        self._run_tally: Tally | None = None  # this train() call's steps
        self._loss_before = (0.0, 0)  # the loss sum and steps of the run before this call
        self._last_eval: tuple[int | None, dict[str, float]] = (None, {})
        self._eval_model: nn.Module | None = None
        self._in_train = False
        self._counts_flops = False  # the model estimates its floating-point operations
        self._every = Intervals()

    # ------------------------------------------------------------------ composition
    def make_topology(self) -> Topology:
        """This process's place in the job, from the launcher's environment."""
        return Topology.from_env()

    def make_strategy(self, device: torch.device) -> ParallelStrategy:
        """The parallelism strategy this trainer runs (one process: none)."""
        return ParallelStrategy(self.args, self.topology, device)

    @property
    def device(self) -> torch.device:
        """This rank's device (the strategy's, which may choose it when the job starts)."""
        return self.strategy.device

    @device.setter
    def device(self, device: torch.device) -> None:
        self.strategy.device = device

    @property
    def is_main_process(self) -> bool:
        return self.topology.is_main

    @property
    def checkpoints_dir(self) -> Path:
        return Path(self.args.output_dir) / "checkpoints"

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (an instance or a class to instantiate)."""
        self.callback_handler.add(callback)

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
        with self.strategy.process_group(), numerics(self.args):
            try:
                self._in_train = True
                self._setup_training()
                checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
                if checkpoint is not None:
                    self._load_checkpoint(checkpoint.path)
                with self._signals:
                    while True:
                        try:
                            output = self._train_loop()
                            break
                        except RollBack as back:  # a callback asked (forge/train/rollback.py)
                            roll_back(self, back.request)
                self.checkpoints.wait()
                return output
            except Exception as error:
                # A background commit that failed is why the run stops, even where the training
                # thread fails first: another rank that stopped for it breaks this rank's next
                # collective, whose error says nothing of the cause.
                failure = self.checkpoints.failure() if self.checkpoints else None
                if isinstance(failure, Exception):
                    logger.debug("the training thread stopped with: %s", error)
                    raise failure from error
                if not isinstance(error, CheckpointError):  # a save's own failure: not again
                    self._keep_trained_steps()
                raise
            finally:
                if self.checkpoints is not None:  # a failed run still finishes a commit
                    self.checkpoints.finish_quietly()
                self._in_train = False
                self.release_wrappers()

    def _train_loop(self) -> TrainOutput:
        args, state = self.args, self.state
        self._log_start()
        self.micro_batches.start(state)  # a resumed run keeps the micro-batch size that fitted
        self._call("on_train_begin")
        if args.eval_on_start and self._evaluation_enabled():
            self._evaluate_in_training(start=True)  # a first check of metrics and eval data
        self.wrapped_model.train()
        start_step, run_tally = state.global_step, Tally()
        self._run_tally = run_tally  # this call's steps; the run's loss before it is saved
        self._start_step = start_step
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
                self._step_open = False  # a completed step: its state may be saved
                self._stop_agreed = self._stop_vote.cast(step.stop)
                self._call("on_step_end")
                synced = self._log_evaluate_save(epoch_end=False)
                self.checkpoints.poll(synced)
                if self._should_stop(synced):
                    break
            synced = self.data_position.epoch > epoch  # the epoch ran to its end
            if synced:
                synced = self._log_evaluate_save(epoch_end=True)
            self.checkpoints.poll(synced)
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
            self._step_open = True  # until the step is counted (_advance)
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
        self.checkpoints.raise_if_failed()  # a save that failed in the background ends the run
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
        if save and (step >= self.max_steps or args.eval_on_save):
            evaluate = True  # the final checkpoint's metrics (every one's with eval_on_save)
        evaluate = evaluate and self._evaluation_enabled()
        if log:
            self.log_step()
        if evaluate:
            improved = self._evaluate_in_training()
            # a callback may ask for a save on what it saw in the evaluation (HF does the same)
            save = save or control.should_save or (improved and args.save_strategy == "best")
            control.should_save = False
        if save:
            self.save_checkpoint()
        return log or evaluate or save

    def _should_stop(self, synced: bool) -> bool:
        """Max steps, a callback's request, or a signal (which saves and raises).

        One process acts on a signal at the next step boundary. The ranks of a job agree on it
        in each step's own all-reduce and read the agreement a step later (``StopVote``): a
        signal stops the job one or two steps after it arrived, every rank at the same step.
        torchrun passes signals to every rank.
        """
        signum = self._signals.received if not self.topology.distributed else self._stop_agreed
        if signum:
            checkpoint = self.save_checkpoint()
            self.checkpoints.wait()
            self._call("on_train_end", interrupted=signum)
            raise TrainingInterrupted(signum, self.state.global_step, str(checkpoint))
        if self.control.rollback is not None:  # a callback's: restore, then train on
            request, self.control.rollback = self.control.rollback, None
            if can_roll_back(self, request):  # else the requester stops the run
                raise RollBack(request)
        return self.state.global_step >= self.max_steps or self.control.should_training_stop

    def _finish(self, steps: int, run_tally: Tally) -> TrainOutput:
        args, state = self.args, self.state
        if self._tally.steps and args.logging_strategy != "no":
            self.log_step()  # the steps since the last log
        run_tally.settle()
        if self._evaluation_enabled():
            self._evaluate_in_training()
        if args.save_final_checkpoint:
            self.save_checkpoint()
        self.checkpoints.wait()  # the best checkpoint and run.json are final from here on
        self._settle()
        summary = train_summary(steps, run_tally, self.state, self._counts_flops)
        summary["train_loss"] = self._run_loss()  # the run's, a resumed one's included
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
        self._call("on_train_end")
        metrics = {
            **summary,
            "total_tokens": float(state.tokens_seen),
            "nonfinite_skipped": float(state.nonfinite_skipped),
            **self._last_eval[1],
        }
        return TrainOutput(state.global_step, summary["train_loss"], metrics)

    # ------------------------------------------------------------------ one step
    def forward_backward(self, window: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over one optimizer step's micro-batches, as the strategy runs
        them; (loss, tokens) on this rank. Each micro-batch's loss is its share of the step's
        (``window_loss``), so a short last window averages over what it has. With
        ``auto_find_batch_size`` the batches may run in smaller pieces, the step unchanged
        (forge/train/batch_finder.py)."""
        window = [self._to_device(batch) for batch in window]
        num_items = self.loss.num_items_in_batch(window, self.model, self._items_ranks_sum)
        loss_of = functools.partial(self.window_loss, num_items_in_batch=num_items)
        return self.micro_batches.run(
            window, loss_of, self.strategy.forward_backward, self._restart_step
        )

    def _restart_step(self) -> Callable[[], None]:
        """Called before a step's first forward; returns what undoes a partial try of it: its
        gradients and the model metrics it added (an out-of-memory error, then a retry)."""
        mark = self._tally.outputs_mark()

        def undo() -> None:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            else:  # the sanity pass's step has no optimizer
                self.model.zero_grad(set_to_none=True)
            self._tally.rewind_outputs(mark)

        return undo

    def window_loss(
        self, batch: Batch, window_size: float, num_items_in_batch: torch.Tensor | None
    ) -> torch.Tensor:
        """One micro-batch's share of the optimizer step's loss on this rank.

        A per-batch mean is divided by the window's length. A ``compute_loss_func`` loss
        normalised by ``num_items_in_batch`` already is the step's (the window's label tokens,
        over the ranks with ``average_tokens_across_devices``): it is multiplied by the
        data-parallel size instead, which the gradients' average over ranks takes back out (HF's
        rule).
        """
        items = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        if takes_keyword(self.compute_loss, "return_outputs"):
            loss, outputs = self.compute_loss(
                self.wrapped_model, batch, return_outputs=True, **items
            )
            self._tally.add_outputs(outputs)  # the model's extra loss parts and metrics
        else:  # a compute_loss overridden without return_outputs gives the loss only
            loss = self.compute_loss(self.wrapped_model, batch, **items)
        if num_items_in_batch is None:
            return loss / window_size
        return loss * self.loss.items_ranks(self.topology)

    def _items_ranks_sum(self, count: torch.Tensor) -> torch.Tensor:
        """``num_items_in_batch`` summed over the ranks that count it."""
        return self.all_reduce_sum(count) if self.loss.items_ranks(self.topology) > 1 else count

    def compute_loss(
        self,
        model: nn.Module,
        batch: Batch,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss of one batch, as Hugging Face's ``Trainer.compute_loss``: the model's own
        ``.loss``, or ``compute_loss_func`` / label smoothing over its outputs
        (forge/train/loss.py). ``return_outputs`` also returns the model's outputs."""
        return self.loss.compute(model, batch, return_outputs, num_items_in_batch)

    def clip_gradients(self) -> torch.Tensor:
        """The total gradient norm before clipping; clips to ``max_grad_norm`` when set."""
        return self.strategy.clip_gradients(self.model, self.optimizer)

    def optimizer_step(self) -> None:
        self.strategy.optimizer_step(self.optimizer)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (every rank gets the result)."""
        return self.strategy.all_reduce_sum(tensor)

    def reduce_step(
        self,
        loss: torch.Tensor,
        tokens: torch.Tensor,
        grad_norm: torch.Tensor,
        samples: float | torch.Tensor = 0,
        flops: float = 0.0,
    ) -> StepResult:
        """Agree on the step across ranks with one all-reduce of (loss, tokens, samples,
        flops); ``samples`` and ``flops`` are this rank's, known on the host.

        The summed loss is non-finite exactly when some rank's loss is, and gradients are
        already synchronised, so every rank takes the same skip decision. Everything stays on
        the device: nothing here waits for the step to finish.
        """
        signum = float(self._signals.received)  # the stop vote rides along (StopVote)
        values = (samples, flops, signum, 1.0 if signum else 0.0)
        counts = [torch.as_tensor(v, dtype=torch.float64, device=loss.device) for v in values]
        stats = self.all_reduce_sum(torch.stack([loss.double(), tokens.double(), *counts]))
        loss_sum, total_tokens, total_samples, total_flops = stats[:4].unbind()
        finite = torch.isfinite(loss_sum)
        if self.scaler is None:  # with a grad scaler, overflowing gradients are its to skip
            finite = finite & torch.isfinite(grad_norm)
        return StepResult(
            loss_sum / self.topology.dp_size,
            total_tokens,
            grad_norm,
            finite,
            total_samples / self.topology.num_stages,  # every stage of a replica sees the batch
            total_flops,
            stop=stats[4:].detach(),
        )

    def _count_work(self, window: list[Batch]) -> tuple[int | torch.Tensor, float]:
        """The items of this rank's micro-batches (the sequences of packed rows: a tensor on
        the device) and their floating-point operations (0 for a model that gives no
        estimate), from the batches' shapes."""
        samples, flops = 0, 0.0
        for batch in window:
            packed = sequence_count(batch)  # a packed row holds several items
            samples += batch_size_of(batch) if packed is None else packed
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

    def _step_unless_nonfinite(self, step: StepResult) -> torch.Tensor | bool:
        """The optimizer step, skipped when ``step`` is non-finite and ``skip_nonfinite`` is on.

        An optimizer that takes torch's ``found_inf`` (the fused ones, as the default AdamW,
        which a grad scaler drives the same way) skips on the device. Any other needs the
        decision on the host, which waits for the step's gradients: one host sync per step.

        Returns whether the step was applied: True, or a bool tensor on the device where the
        decision was taken there (a grad scaler also skips steps whose gradients overflow).
        """
        self.checkpoints.before_optimizer_step()  # a save may still be copying what it changes
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
        listen (an average of the weights updates only after an applied step). Reading a decision taken
        on the device waits for the step, so it is read only when something listens."""
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
        optimizer = self.strategy.inner_optimizer(self.optimizer)
        if self.scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False):
            return optimizer
        return None

    def autocast(self) -> AbstractContextManager:
        """bf16 / fp16 autocast for the forward pass when requested."""
        return self.strategy.autocast()

    def state_dict(self) -> dict[str, Any]:
        """The loop's own counters: a checkpoint component like any other."""
        self._settle()
        recording = self.checkpoints.recording if self.checkpoints is not None else {}
        return {
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "position": {"epoch": self.data_position.epoch, "batch": self.data_position.batch},
            "trainer_state": {**self.state.state_dict(), **recording},
            "log_tally": self._tally.state_dict(),
            "run_loss": dict(zip(("sum", "steps"), self._run_loss_sums(), strict=True)),
        }

    def _run_loss_sums(self) -> tuple[float, int]:
        """The loss summed over every finite step of the run so far (the steps before a resume
        too), and their count."""
        total, steps = self._loss_before
        if self._run_tally is not None:
            self._run_tally.settle()
            total, steps = total + self._run_tally.loss_sum, steps + self._run_tally.finite_steps
        return total, steps

    def _run_loss(self) -> float:
        """The mean loss of every step of the run so far: what a straight run reports."""
        total, steps = self._run_loss_sums()
        return total / steps if steps else float("nan")

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.state
        state.global_step = int(saved["global_step"])
        state.epoch = float(saved["epoch"])
        state.load_state_dict(saved.get("trainer_state", {}))
        self._tally.load_state_dict(saved.get("log_tally", {}))
        run_loss = saved.get("run_loss") or {}  # checkpoints before it: the resumed steps only
        self._loss_before = (float(run_loss.get("sum", 0.0)), int(run_loss.get("steps", 0)))
        position = saved["position"]
        self.data_position.seek(int(position["epoch"]), int(position["batch"]))

    def save_checkpoint(self) -> Path:
        """Save the current step (every rank calls this); see forge/checkpoint/manager.py. A
        checkpoint records the metrics of an evaluation at its step; once it is committed it
        becomes the last (and perhaps best) checkpoint and the callbacks' ``on_save`` runs."""
        step = self.state.global_step
        metrics = self._last_eval[1] if self._last_eval[0] == step else {}
        return self.checkpoints.save(step, epoch=self.state.epoch, metrics=metrics)

    def _on_saved(
        self, step: int, epoch: float | None, path: Path, metrics: dict[str, float]
    ) -> None:
        """``on_save``, once a checkpoint is in place. Callbacks see the state as it was at the
        snapshot (its step and epoch), not the live one, which the loop has moved
        on from."""
        saved = copy.copy(self.state)
        saved.global_step, saved.epoch = step, epoch
        self._call("on_save", state=saved, checkpoint_path=path, metrics=metrics)

    # ------------------------------------------------------------------ evaluation in training
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
        return self.checkpoints.improves(value)

    # ------------------------------------------------------------------ logging
    def log_step(self) -> None:
        """Report the steps since the last log: mean loss, the model's extra metrics (each
        float or 0-d tensor field of its outputs: ``model_metrics``), lr, grad norm, tokens/s
        (when the batches hold tokens: ``count_tokens``), epoch, peak memory (``peak_memory``)."""
        self._settle()
        tokens_seen = self.args.include_num_input_tokens_seen != "no"
        logs = step_logs(self._tally, self.state, current_lr(self.lr_scheduler), tokens_seen)
        logs.update(peak_memory(self.device))
        self._tally = Tally()
        self._call("on_log", logs=logs)

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
