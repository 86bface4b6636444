"""The sanity pass: what training will run, run once before it starts (as Lightning's
``num_sanity_val_steps``), so a mistake costs seconds instead of the steps trained before it.

On a trainer built from the config (in the launching process, before any run directory exists),
it runs the model-transform stage (adapters with their tokenizer, activation checkpointing,
compile, the strategy's wrap as one process has it), builds the optimizer and its schedule
(a model's own too, e.g. a LightningModule's ``configure_optimizers``), the first training
micro-batch of the configured loader at the configured batch size through the trainer's own
forward and backward
(no optimizer step; for a packed batch, the proof that its sequences stay apart:
forge/train/packing.py), and ``num_sanity_val_steps`` evaluation batches through the whole
evaluation path: the evaluation loader and collator, the forward, ``preprocess_logits_for_metrics``,
``compute_metrics`` and the check of ``metric_for_best_model``. It changes nothing: the random
generators are put back as they were, nothing is written, and the trainer it ran on is thrown
away. A failure is a ``SanityFailure`` naming the part that failed, which the launcher locates
at that part's line of the config.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
from collections.abc import Iterator
from typing import Any

#: the parts a failure is located at: the trainer's constructor argument each one is
PARTS = {
    "data_collator": "data_collator",
    "train_dataset": "train_dataset",
    "eval_dataset": "eval_dataset",
    "model": "model",
    "compute_metrics": "compute_metrics",
    "preprocess_logits_for_metrics": "preprocess_logits_for_metrics",
    "args": "args",
}


_STAND_IN = contextvars.ContextVar("forge_sanity_stand_in", default=False)


@contextlib.contextmanager
def one_process_stand_in() -> Iterator[None]:
    """Trainers built inside are one-process stand-ins for a job of several processes (the
    sanity pass's, and ``forge evaluate``'s of a pipeline run): a pipeline of several stages
    is built as one stage (the job's own split is checked by its plan,
    forge/launch/preflight.py), so the pass still runs its batches."""
    token = _STAND_IN.set(True)
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def is_stand_in() -> bool:
    """Whether the trainer being built is the sanity pass's one-process stand-in."""
    return _STAND_IN.get()


class SanityFailure(Exception):
    """The sanity pass failed in ``part`` (a trainer argument) while ``doing``."""

    def __init__(self, part: str, doing: str, error: BaseException) -> None:
        self.part, self.doing, self.error = part, doing, error
        #: failed in the evaluation batches, which num_sanity_val_steps: 0 leaves out (a failure
        #: before them is one the run's first step meets anyway)
        self.evaluating = False
        super().__init__(f"{doing}: {type(error).__name__}: {error}")


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Python's, numpy's and torch's generators (CUDA's too) as they were, afterwards."""
    import numpy as np
    import torch

    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def run_sanity_pass(trainer: Any, eval_batches: int) -> None:
    """One training micro-batch forward and backward, and ``eval_batches`` evaluation batches,
    through ``trainer``'s own paths (see the module docstring). ``trainer`` is not used for
    training afterwards."""
    phase = {"items": "training"}
    with preserved_random_state(), trainer.strategy.process_group():
        _wrap(trainer, "data_collator", lambda: f"collating {phase['items']} items")
        _wrap(trainer, "compute_metrics", lambda: "computing the metrics")
        _wrap(trainer, "preprocess_logits_for_metrics", lambda: "preprocessing the logits")
        with _part("model", "building the model (the transform stage)"):
            trainer.wrapped_model = trainer.transform_model()
        with _part("train_dataset", "loading the first training batch"):
            batch = next(iter(trainer.build_train_loader()))
        with _part("model", "building the optimizer and its schedule"):
            trainer.setup_optimization()  # a model's own: configure_optimizers
        with _part("model", "checking that the packed sequences of a batch stay apart"):
            check_packed_batch(trainer, batch)
        phase["items"] = "evaluation"
        trainer.wrapped_model.train()
        with _part("model", "the first training batch's forward and backward"):
            trainer.forward_backward([batch])
        evaluates = trainer.eval_dataset is not None and trainer.args.eval_strategy != "no"
        if eval_batches and evaluates:
            try:
                _evaluate(trainer, eval_batches)
            except SanityFailure as failure:
                failure.evaluating = True
                raise
        trainer.release_wrappers()


def check_packed_batch(trainer: Any, batch: Any) -> None:
    """For a packed batch (forge/train/packing.py): what is known of the model and the trainer,
    then the proof on the real model, that each sequence's logits are those it has alone."""
    from forge.train.packing import FIX, is_packed_batch, packing_leak, packing_refusal

    if not is_packed_batch(batch):
        return
    refusal = packing_refusal(
        trainer.wrapped_model,
        use_cache=trainer.args.use_cache,
        batch_keys=list(batch),
        trainer_reason=getattr(trainer, "refuses_packed_batches", None),
    )
    if refusal:
        raise ValueError("; ".join(refusal))
    leak = packing_leak(trainer.wrapped_model, batch)
    if leak:
        raise ValueError(f"{leak}; {FIX}")


def _evaluate(trainer: Any, batches: int) -> None:
    args = trainer.args
    limit = args.max_eval_batches
    args.max_eval_batches = batches if limit is None else min(batches, limit)
    try:
        datasets = trainer.eval_dataset
        parts = datasets if isinstance(datasets, dict) else {None: datasets}
        given: set[str] = set()
        with trainer._evaluation_weights():
            for name, dataset in parts.items():
                prefix = "eval" if name is None else f"eval_{name}"
                with _part("model", f"{batches} evaluation batch(es)"):
                    output = trainer.evaluation_loop(
                        dataset,
                        description=prefix,
                        prediction_loss_only=True if trainer.compute_metrics is None else None,
                        metric_key_prefix=prefix,
                    )
                with _part("args", "checking metric_for_best_model"):
                    trainer._check_best_metric(output.metrics)
                given.update(output.metrics)
        with _part("callbacks", "checking the evaluation metrics the callbacks watch"):
            problems = [
                problem
                for callback in trainer.callback_handler.callbacks
                if callable(getattr(callback, "unseen_eval_metrics", None))
                for problem in callback.unseen_eval_metrics(given)
            ]
            if problems:
                raise ValueError("; ".join(problems))
    finally:
        args.max_eval_batches = limit


def _wrap(trainer: Any, name: str, doing: Any) -> None:
    """Make a failure of the trainer's ``name`` callable a SanityFailure of that part."""
    function = getattr(trainer, name, None)
    if function is None:
        return

    def tagged(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except SanityFailure:
            raise
        except Exception as error:
            raise SanityFailure(name, doing(), error) from error

    setattr(trainer, name, tagged)


@contextlib.contextmanager
def _part(part: str, doing: str) -> Iterator[None]:
    try:
        yield
    except SanityFailure:
        raise
    except Exception as error:
        raise SanityFailure(part, doing, error) from error
