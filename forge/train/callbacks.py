"""Trainer state, control flags and callbacks (progress, JSON lines, TensorBoard, early stopping).

Hooks follow Hugging Face's ``TrainerCallback``: each receives ``(args, state, control,
**kwargs)`` and may set flags on ``control``; ``on_optimizer_step`` also gets ``applied``
(whether the step was applied or skipped); forge's own ``on_register`` lets a callback add
checkpoint components of any scope, and ``evaluation_weights`` choose the weights evaluation
runs with. On rank 0 the trainer always adds the console progress and
``metrics.jsonl``, plus the integrations ``args.report_to`` names (TensorBoard, and Weights &
Biases / MLflow from forge.train.integrations); user callbacks and early stopping run on every
rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from forge.train.args import TrainingArguments

if TYPE_CHECKING:
    from forge.checkpoint import Component

logger = logging.getLogger(__name__)

__all__ = [
    "CallbackHandler",
    "EarlyStoppingCallback",
    "EmptyCacheCallback",
    "JsonlMetricsCallback",
    "ProgressCallback",
    "TensorBoardCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "is_train_summary",
]


@dataclass
class TrainerState:
    """Where training is; what callbacks read and what a checkpoint restores.

    ``epoch`` counts completed epochs plus the fraction of the current one.
    ``best_metric`` / ``best_checkpoint`` are set when a checkpoint is saved with a better
    ``metric_for_best_model``. ``tokens_seen`` counts attention-masked tokens over all ranks;
    ``total_flos`` the floating-point operations of every step so far (Hugging Face's estimate,
    for models that give one: ``BaseTrainer.floating_point_ops``), over all ranks.
    """

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    best_metric: float | None = None
    best_checkpoint: str | None = None
    last_checkpoint: str | None = None
    nonfinite_skipped: int = 0
    tokens_seen: int = 0
    total_flos: float = 0.0
    is_world_process_zero: bool = True
    resumed_from: str | None = None
    #: rows per forward and backward that fitted (``auto_find_batch_size``; None: not searched)
    train_batch_size: int | None = None

    _saved: ClassVar[tuple[str, ...]] = (
        "best_metric",
        "best_checkpoint",
        "last_checkpoint",
        "nonfinite_skipped",
        "tokens_seen",
        "total_flos",
        "train_batch_size",
    )

    def state_dict(self) -> dict[str, Any]:
        """The fields a checkpoint carries (step and epoch are stored beside them)."""
        return {name: getattr(self, name) for name in self._saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self._saved:
            if name in state:
                setattr(self, name, state[name])


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the step flags reset after every step."""

    should_training_stop: bool = False
    should_log: bool = False
    should_evaluate: bool = False
    should_save: bool = False
    #: a callback's request to restore an earlier checkpoint at this step boundary and go on
    #: past a window of batches (forge.train.rollback.RollbackRequest)
    rollback: Any = None

    def reset_step_flags(self) -> None:
        self.should_log = self.should_evaluate = self.should_save = False


class TrainerCallback:
    """Base class: override the hooks you need. All hooks are no-ops.

    A callback with ``state_dict()`` / ``load_state_dict()`` has its state saved in every
    checkpoint and restored on resume, keyed by class name (shared: rank 0 writes it). State
    of another scope (a stage's, a rank's) goes in through ``on_register``.
    """

    def on_register(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        register: Callable[[Component], None],
        **kwargs: Any,
    ) -> None:
        """Once per ``train()``, after the model, optimizer and scheduler are built and before
        a checkpoint is restored: ``register(Component(name, obj, scope))`` adds checkpoint
        state, e.g. ``Scope.STAGE`` for something that follows this stage's weights (an EMA
        under the pipeline trainer) or ``Scope.RANK`` for something each rank keeps.
        ``kwargs`` hold ``model`` (this rank's, unwrapped), ``optimizer``, ``lr_scheduler`` and
        ``topology``."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        pass

    def on_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        applied: bool,
        **kwargs: Any,
    ) -> None:
        """After each optimizer step, before the scheduler steps and the gradients are cleared
        (``state.global_step`` still counts the steps before it). ``applied`` is False when
        the step was skipped (a non-finite loss or gradient norm with ``skip_nonfinite``, or
        a grad scaler's overflow). Where the skip is decided on the device, overriding this
        hook makes every step wait for it on the host."""

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        pass

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float],
        **kwargs: Any,
    ) -> None:
        pass

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float],
        **kwargs: Any,
    ) -> None:
        pass

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        checkpoint_path: Path,
        metrics: dict[str, float],
        **kwargs: Any,
    ) -> None:
        pass

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        pass

    def evaluation_weights(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> AbstractContextManager | None:
        """forge's: a context in which evaluation runs with other weights than the model's own
        (a moving average swapped into the parameters, and the weights put back after, whatever
        happens inside), or None to leave them."""
        return None


class CallbackHandler:
    """Calls a list of callbacks in order and gathers their checkpointable state."""

    def __init__(self, callbacks: list[TrainerCallback]) -> None:
        self.callbacks = list(callbacks)
        self.apart: list[TrainerCallback] = []  # checkpoint components of their own

    def keep_apart(self, components: list[Any]) -> None:
        """Callbacks that registered themselves as checkpoint components (of any scope): their
        state is theirs to save, not part of the callbacks' shared state."""
        self.apart = [cb for cb in self.callbacks if any(cb is obj for obj in components)]

    def add(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def remove(self, callback: TrainerCallback) -> None:
        """Take ``callback`` (this very object) out, if it is in."""
        self.callbacks = [cb for cb in self.callbacks if cb is not callback]

    def call(
        self,
        event: str,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:  # an object that is no TrainerCallback may lack newer hooks
                hook(args, state, control, **kwargs)

    @contextmanager
    def evaluation_weights(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> Iterator[None]:
        """Every callback's ``evaluation_weights`` context, entered in order for an evaluation
        and left in reverse order after it."""
        with ExitStack() as stack:
            for callback in self.callbacks:
                hook = getattr(callback, "evaluation_weights", None)
                context = hook(args, state, control) if hook is not None else None
                if context is not None:
                    stack.enter_context(context)
            yield

    def listens(self, event: str) -> bool:
        """Whether some callback does something on ``event`` (a hook the base leaves empty
        costs nothing to skip)."""
        default = getattr(TrainerCallback, event)
        return any(
            getattr(type(callback), event, default) is not default for callback in self.callbacks
        )

    def _stateful(self) -> dict[str, TrainerCallback]:
        named: dict[str, TrainerCallback] = {}
        for callback in self.callbacks:
            if any(callback is apart for apart in self.apart):
                continue
            if hasattr(callback, "state_dict") and hasattr(callback, "load_state_dict"):
                name, n = type(callback).__name__, 1
                while name in named:
                    n += 1
                    name = f"{type(callback).__name__}#{n}"
                named[name] = callback
        return named

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self._stateful().items()}  # type: ignore[attr-defined]

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for name, callback in self._stateful().items():
            if name in states:
                callback.load_state_dict(states[name])  # type: ignore[attr-defined]
            else:
                logger.warning("checkpoint has no state for callback %s; it starts fresh", name)


def is_train_summary(logs: dict[str, Any]) -> bool:
    """Whether an ``on_log`` call carries the end-of-training summary (``train_runtime``,
    ``train_samples_per_second``, ... as Hugging Face's Trainer logs it) rather than a step's
    numbers."""
    return "train_runtime" in logs


def format_metrics(values: dict[str, float]) -> str:
    """``loss 4.1234 | learning_rate 3.00e-04``: a compact line for logs."""
    parts = []
    for key, value in values.items():
        if isinstance(value, float):
            text = f"{value:.3e}" if value != 0 and abs(value) < 1e-3 else f"{value:.4g}"
        else:
            text = str(value)
        parts.append(f"{key} {text}")
    return " | ".join(parts)


class ProgressCallback(TrainerCallback):
    """A tqdm bar on stderr (loss, lr and tok/s in its postfix); without a TTY, or with
    ``disable_tqdm``, a plain log line every ``logging_steps`` instead."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.disable_tqdm or not sys.stderr.isatty():
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=state.max_steps,
            initial=state.global_step,
            desc="train",
            file=sys.stderr,
            dynamic_ncols=True,
            unit="step",
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs, **kwargs):
        if is_train_summary(logs):
            line = f"trained to step {state.global_step} | {format_metrics(logs)}"
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                logger.info(line)
            return
        if self.bar is None:
            logger.info("step %d/%d | %s", state.global_step, state.max_steps, format_metrics(logs))
            return
        postfix = {"loss": f"{logs['loss']:.4f}"} if "loss" in logs else {}
        if "learning_rate" in logs:
            postfix["lr"] = f"{logs['learning_rate']:.2e}"
        if "tokens_per_second" in logs:
            postfix["tok/s"] = f"{logs['tokens_per_second']:.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        # keep the history above the bar, so a falling loss can be read at a glance
        self.bar.write(f"step {state.global_step} | {format_metrics(logs)}", file=sys.stderr)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        line = f"eval at step {state.global_step} | {format_metrics(metrics)}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            logger.info(line)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no inf / nan
    return value


class JsonlMetricsCallback(TrainerCallback):
    """Appends one JSON object per log and per evaluation to ``<output_dir>/metrics.jsonl``.

    At the start of training, lines with a step beyond the starting step are dropped, so a
    resumed run's file reads as one consistent history.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None

    def _file(self, args: TrainingArguments) -> Path:
        return self.path or Path(args.output_dir) / "metrics.jsonl"

    def on_train_begin(self, args, state, control, **kwargs):
        path = self._file(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                step = json.loads(line).get("step", 0)
            except (ValueError, AttributeError):
                continue  # a line torn by a crash
            if isinstance(step, int) and step <= state.global_step:
                kept.append(line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)

    def _write(self, args: TrainingArguments, record: dict[str, Any]) -> None:
        path = self._file(args)
        path.parent.mkdir(parents=True, exist_ok=True)  # evaluate() may run before train()
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")

    def on_log(self, args, state, control, logs, **kwargs):
        self._write(args, {"step": state.global_step, **logs})

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        self._write(args, {"step": state.global_step, "epoch": state.epoch, **metrics})


class TensorBoardCallback(TrainerCallback):
    """Scalars to ``<output_dir>/tb`` (``train/*`` and ``eval/*``); a resumed run purges the
    events written after its starting step."""

    def __init__(self, log_dir: str | os.PathLike | None = None) -> None:
        self.log_dir = log_dir
        self.writer: Any = None

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.log_dir or os.path.join(args.output_dir, "tb")
        purge = state.global_step + 1 if state.global_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def _scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key.removeprefix('eval_')}", value, step)
        self.writer.flush()

    def on_log(self, args, state, control, logs, **kwargs):
        self._scalars("train", logs, state.global_step)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        self._scalars("eval", metrics, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass
class _EarlyStoppingState:
    best: float | None = None
    evals_without_improvement: int = 0


class EarlyStoppingCallback(TrainerCallback):
    """Stops training after ``patience`` evaluations without an improvement of more than
    ``threshold`` in ``args.metric_for_best_model``; its counters survive resume.

    ``patience`` / ``threshold`` default to ``args.early_stopping_patience`` /
    ``args.early_stopping_threshold``.
    """

    def __init__(self, patience: int | None = None, threshold: float | None = None) -> None:
        self.patience = patience
        self.threshold = threshold
        self.state = _EarlyStoppingState()

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        metric = args.metric_for_best_model or "eval_loss"
        value = metrics.get(metric)
        if value is None:
            logger.warning(
                "early stopping: metric %r not in the evaluation metrics %s; "
                "set trainer.args.metric_for_best_model",
                metric,
                sorted(metrics),
            )
            return
        patience = self.patience or args.early_stopping_patience or 1
        threshold = args.early_stopping_threshold if self.threshold is None else self.threshold
        best = self.state.best
        if args.greater_is_better is False:
            improved = best is None or value < best - threshold
        else:
            improved = best is None or value > best + threshold
        if improved:
            self.state = _EarlyStoppingState(best=value)
            return
        self.state.evals_without_improvement += 1
        if self.state.evals_without_improvement >= patience:
            control.should_training_stop = True
            if state.is_world_process_zero:
                logger.info(
                    "early stopping at step %d: %s has not improved on %.6g for %d evaluations",
                    state.global_step,
                    metric,
                    best,
                    patience,
                )

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {f.name for f in fields(_EarlyStoppingState)}
        self.state = _EarlyStoppingState(**{k: v for k, v in state.items() if k in names})


class EmptyCacheCallback(TrainerCallback):
    """Empties the accelerator's memory cache every ``args.torch_empty_cache_steps`` steps."""

    def on_step_end(self, args, state, control, **kwargs):
        every = args.torch_empty_cache_steps
        if every and state.global_step % every == 0:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            elif hasattr(torch, "xpu") and torch.xpu.is_available():
                torch.xpu.empty_cache()
            elif torch.backends.mps.is_available():
                torch.mps.empty_cache()
