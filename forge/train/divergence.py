"""Divergence detectors: a callback that watches the logged loss, gradient norm and evaluation
metrics and warns or stops the run when training diverges.

``DivergenceDetector`` is the entry point a template names in its ``callbacks`` block; with no
argument it watches the training loss with a ``LossSpike`` (a fast and a slow moving average)
and stops the run, with a checkpoint, when the loss jumps far above its recent level. More
specific detectors go in its ``detectors`` list:

- ``LossSpike``: a fast against a slow exponential moving average of a metric (a factor, a
  z-score or an absolute limit), after a warm-up;
- ``SustainedRise``: the mean of the last ``window`` values against the mean of the window
  before it (a climb over hundreds of steps that no single value shows);
- ``GradNormSpike``: a ``LossSpike`` on ``grad_norm``;
- ``NonFiniteStreak``: logged windows in a row whose every step had a non-finite loss or gradient
  norm (the steps ``skip_nonfinite`` skipped);
- ``MetricRise``: an evaluation metric (``eval_loss``) worse ``patience`` times in a row.

Detectors read only what every rank logs alike (the loss and gradient norm summed over the
ranks, the evaluation's metrics), so all ranks decide together at the same step with no
extra communication, and nothing here waits for the device. Their state is checkpoint state: a
resumed run detects exactly what the straight run would have.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection
from typing import Any

from forge.suggest import suggestion
from forge.text import short_list
from forge.train.callbacks import TrainerCallback, is_train_summary

logger = logging.getLogger(__name__)

__all__ = [
    "DivergenceDetector",
    "GradNormSpike",
    "LossSpike",
    "MetricRise",
    "NonFiniteStreak",
    "SustainedRise",
]

ACTIONS = ("warn", "stop", "rollback")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _fraction(name: str, owner: str, value: float) -> float:
    _require(
        isinstance(value, (int, float)) and 0 < value <= 1,
        f"{owner}: {name} must be a smoothing factor in (0, 1] (got {value!r})",
    )
    return float(value)


def _positive_int(name: str, owner: str, value: int) -> int:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        f"{owner}: {name} must be a positive integer (got {value!r})",
    )
    return value


class Detector:
    """One rule over one logged metric. ``observe`` takes each logged value (and the optimizer
    steps since the previous log) and returns a sentence naming the values when the rule
    fires, else None. ``state_dict`` / ``load_state_dict`` carry its memory across a resume."""

    metric: str = "loss"

    @property
    def name(self) -> str:
        return type(self).__name__

    def observe(self, value: float, steps: int) -> str | None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LossSpike(Detector):
    """A metric (the training ``loss``) whose fast moving average rises above ``factor`` times
    its slow one; with ``zscore``, a value more than that many standard deviations above the
    slow average; with ``limit``, a value above it. Non-finite values are ``NonFiniteStreak``'s.

    ``fast`` / ``slow`` are the averages' smoothing factors (the weight of each new value);
    ``warmup`` logged values pass before it may fire, while the averages settle.
    """

    def __init__(
        self,
        metric: str = "loss",
        factor: float | None = 3.0,
        zscore: float | None = None,
        limit: float | None = None,
        fast: float = 0.1,
        slow: float = 0.01,
        warmup: int = 10,
    ) -> None:
        owner = type(self).__name__
        _require(
            factor is None or (isinstance(factor, (int, float)) and factor > 1),
            f"{owner}: factor must be a number above 1 (got {factor!r}); None turns it off",
        )
        _require(
            zscore is None or (isinstance(zscore, (int, float)) and zscore > 0),
            f"{owner}: zscore must be a positive number (got {zscore!r}); None turns it off",
        )
        _require(
            factor is not None or zscore is not None or limit is not None,
            f"{owner}: give factor, zscore or limit; with none of them it never fires",
        )
        self.metric, self.factor, self.zscore, self.limit = metric, factor, zscore, limit
        self.fast_weight = _fraction("fast", owner, fast)
        self.slow_weight = _fraction("slow", owner, slow)
        _require(slow < fast, f"{owner}: slow ({slow}) must be below fast ({fast})")
        # a value that jumps without bound lifts the fast average at most fast/slow times the slow
        _require(
            factor is None or factor < fast / slow,
            f"{owner}: factor ({factor}) must be below fast / slow ({fast / slow:g}), the most "
            "the fast average can exceed the slow one; lower it or widen fast and slow",
        )
        _require(
            isinstance(warmup, int) and warmup >= 0,
            f"{owner}: warmup must be a number of logged values >= 0 (got {warmup!r})",
        )
        self.warmup = warmup
        self.seen, self.fast, self.slow, self.variance = 0, 0.0, 0.0, 0.0

    def observe(self, value: float, steps: int) -> str | None:
        if not math.isfinite(value):
            return None
        if self.seen == 0:
            self.fast = self.slow = value
        deviation = value - self.slow
        self.fast += self.fast_weight * (value - self.fast)
        self.slow += self.slow_weight * deviation
        self.variance = (1 - self.slow_weight) * (
            self.variance + self.slow_weight * deviation * deviation
        )
        self.seen += 1
        if self.seen <= self.warmup:
            return None
        if self.limit is not None and value > self.limit:
            return f"{self.metric} {value:.6g} is above the limit {self.limit:.6g}"
        if self.factor is not None and self.fast > self.factor * self.slow > 0:
            return (
                f"{self.metric}'s fast average {self.fast:.6g} is above {self.factor:g} x its "
                f"slow average {self.slow:.6g} (last value {value:.6g})"
            )
        spread = math.sqrt(self.variance)
        if self.zscore is not None and spread > 0 and deviation / spread > self.zscore:
            return (
                f"{self.metric} {value:.6g} is {deviation / spread:.3g} standard deviations above "
                f"its slow average {self.slow:.6g} (threshold {self.zscore:g})"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "fast": self.fast, "slow": self.slow, "var": self.variance}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen, self.fast = int(state["seen"]), float(state["fast"])
        self.slow, self.variance = float(state["slow"]), float(state["var"])


class GradNormSpike(LossSpike):
    """A ``LossSpike`` on the gradient norm (before clipping): an explosion of the gradients
    that clipping hides from the loss for a while."""

    def __init__(self, metric: str = "grad_norm", factor: float | None = 5.0, **kwargs) -> None:
        super().__init__(metric=metric, factor=factor, **kwargs)


class SustainedRise(Detector):
    """The mean of the last ``window`` logged values above ``factor`` times the mean of the
    ``window`` values before it: a loss that climbs slowly and never comes back."""

    def __init__(self, metric: str = "loss", window: int = 50, factor: float = 1.2) -> None:
        owner = type(self).__name__
        self.metric = metric
        self.window = _positive_int("window", owner, window)
        _require(
            isinstance(factor, (int, float)) and factor > 1,
            f"{owner}: factor must be a number above 1 (got {factor!r})",
        )
        self.factor = float(factor)
        self.values: deque[float] = deque(maxlen=2 * window)

    def observe(self, value: float, steps: int) -> str | None:
        if not math.isfinite(value):
            return None
        self.values.append(value)
        if len(self.values) < 2 * self.window:
            return None
        values = list(self.values)
        before = sum(values[: self.window]) / self.window
        recent = sum(values[self.window :]) / self.window
        if before > 0 and recent > self.factor * before:
            return (
                f"{self.metric}'s mean over the last {self.window} logs {recent:.6g} is above "
                f"{self.factor:g} x its mean over the {self.window} before {before:.6g}"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = deque((float(v) for v in state["values"]), maxlen=2 * self.window)


class NonFiniteStreak(Detector):
    """``steps`` optimizer steps in a row with a non-finite loss (or gradient norm), counted in
    whole logged windows whose every step was skipped (exact with ``logging_steps: 1``). A
    window with one finite step ends the streak."""

    def __init__(self, steps: int = 10) -> None:
        self.metric = "loss"
        self.steps = _positive_int("steps", type(self).__name__, steps)
        self.streak = 0

    def observe(self, value: float, steps: int) -> str | None:
        self.streak = self.streak + steps if not math.isfinite(value) else 0
        if self.streak >= self.steps:
            return f"{self.streak} steps in a row had a non-finite loss or gradient norm"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state["streak"])


class MetricRise(Detector):
    """An evaluation metric worse than at the evaluation before, ``patience`` evaluations in a
    row (higher is worse unless ``greater_is_better``)."""

    def __init__(
        self, metric: str = "eval_loss", patience: int = 3, greater_is_better: bool = False
    ) -> None:
        self.metric = metric
        self.patience = _positive_int("patience", type(self).__name__, patience)
        self.greater_is_better = bool(greater_is_better)
        self.previous: float | None = None
        self.rises = 0

    def observe(self, value: float, steps: int) -> str | None:
        worse = self.previous is not None and (
            not math.isfinite(value)
            or (value < self.previous if self.greater_is_better else value > self.previous)
        )
        self.rises = self.rises + 1 if worse else 0
        self.previous = value if math.isfinite(value) else self.previous
        if self.rises >= self.patience:
            return f"{self.metric} got worse {self.rises} evaluations in a row (now {value:.6g})"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"previous": self.previous, "rises": self.rises}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous, self.rises = state["previous"], int(state["rises"])


class DivergenceDetector(TrainerCallback):
    """Watches training for divergence and acts: ``action: warn`` logs a warning when a detector
    fires; ``action: stop`` (the default) stops the run at that step with a checkpoint, and
    ``forge train`` then records the run as ``diverged`` and exits with its own code (3);
    ``action: rollback`` restores the newest checkpoint at least ``anchor_before`` steps before
    the step it fired at, drops the batches from there to ``skip_past`` steps past it, and
    trains on (forge/train/rollback.py); each rollback is kept in ``rollbacks`` (run.json's);
    after ``max_rollbacks`` of them, or with no checkpoint early enough, it stops instead.

    ``detectors``: the rules (default: ``[LossSpike()]``, which catches a loss a thousand times
    its recent level, or three times with the averages' default smoothing). Every detector sees
    every training log (not the end-of-training summary) and every evaluation that has its
    metric. ``diverged`` holds what stopped the run (detector, step, metric, value, message).
    """

    def __init__(
        self,
        detectors: list[Detector] | None = None,
        action: str = "stop",
        max_rollbacks: int = 3,
        skip_past: int = 0,
        anchor_before: int = 1,
    ) -> None:
        _require(
            action in ACTIONS,
            f"DivergenceDetector: action must be one of {', '.join(ACTIONS)} (got {action!r})",
        )
        self.max_rollbacks = _positive_int("max_rollbacks", "DivergenceDetector", max_rollbacks)
        _require(
            isinstance(skip_past, int) and skip_past >= 0,
            f"DivergenceDetector: skip_past must be a number of steps >= 0 (got {skip_past!r})",
        )
        self.skip_past = skip_past
        self.anchor_before = _positive_int("anchor_before", "DivergenceDetector", anchor_before)
        #: every rollback so far (from step, to checkpoint, batches dropped): run.json's
        self.rollbacks: list[dict[str, Any]] = []
        self.detectors = list(detectors) if detectors is not None else [LossSpike()]
        for detector in self.detectors:
            _require(
                isinstance(detector, Detector),
                f"DivergenceDetector: detectors must be forge.train detectors (LossSpike, "
                f"SustainedRise, GradNormSpike, NonFiniteStreak, MetricRise); got {detector!r}",
            )
        self.action = action
        self.alarms = [False] * len(self.detectors)  # firing now: warn once per episode
        self.seen_metric = [False] * len(self.detectors)
        self.last_step = 0
        self.diverged: dict[str, Any] | None = None
        self._history: list[dict[str, Any]] = []

    @property
    def rollback_anchor_before(self) -> int | None:
        """How far before a detection a rollback may go back (None: no rollbacks): the
        checkpoint manager's rotation keeps that anchor (forge/checkpoint/manager.py)."""
        return self.anchor_before if self.action == "rollback" else None

    def check_arguments(self, args: Any, evaluates: bool) -> list[str]:
        """What cannot work with these arguments, found before training: a detector of an
        evaluation metric in a run that never evaluates, of a training metric in a run that
        never logs."""
        problems = []
        if self.action == "rollback" and args.save_strategy == "no":
            problems.append(
                'action "rollback" restores an earlier checkpoint, but save_strategy is "no"; '
                'set trainer.args.save_strategy: "steps" and save_steps'
            )
        for detector in self.detectors:
            metric = detector.metric
            if metric.startswith("eval_") and not evaluates:
                problems.append(
                    f"{detector.name} watches {metric!r}, but this run never evaluates "
                    '(eval_strategy "no" or no eval_dataset); set trainer.args.eval_strategy '
                    "and an eval_dataset, or watch a training metric such as 'loss'"
                )
            elif not metric.startswith("eval_") and args.logging_strategy == "no":
                problems.append(
                    f"{detector.name} watches the logged {metric!r}, but logging_strategy is "
                    '"no"; set trainer.args.logging_strategy: "steps" and logging_steps'
                )
        return problems

    def on_log(self, args, state, control, logs, **kwargs):
        if is_train_summary(logs):
            return
        steps = max(state.global_step - self.last_step, 1)
        self.last_step = state.global_step
        self._observe(args, logs, steps, state, control)

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        self._observe(args, metrics, 0, state, control)

    def _observe(self, args, values: dict[str, Any], steps: int, state, control) -> None:
        for i, detector in enumerate(self.detectors):
            value = values.get(detector.metric)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if steps == 0 and isinstance(detector, NonFiniteStreak):
                continue  # training steps only
            self.seen_metric[i] = True
            reason = detector.observe(float(value), steps)
            if reason is None:
                self.alarms[i] = False
                continue
            if self.action == "warn":
                if not self.alarms[i] and state.is_world_process_zero:
                    logger.warning(
                        "divergence (%s) at step %d: %s", detector.name, state.global_step, reason
                    )
                self.alarms[i] = True
                continue
            if self.action == "rollback" and control.rollback is None and self.diverged is None:
                reason = self._roll_back(state, control, detector, float(value), reason)
                if reason is None:
                    continue
            if self.diverged is None:
                self._stop(state, control, detector, state.global_step, float(value), reason)

    def _stop(self, state, control, detector: Detector, step: int, value: float, reason: str):
        """Stop the run at this step boundary, saying why (``diverged``)."""
        self.diverged = {
            "detector": detector.name,
            "step": step,
            "metric": detector.metric,
            "value": value,
            "message": reason,
        }
        control.should_training_stop = True
        if state.is_world_process_zero:
            logger.error(
                "divergence (%s) at step %d: %s; stopping the run", detector.name, step, reason
            )

    def _roll_back(
        self, state, control, detector: Detector, value: float, reason: str
    ) -> str | None:
        """Ask for a rollback (None), or say why the run stops instead. Whether a checkpoint
        is early enough is the loop's to find (once the saves in flight are committed); if
        none is, ``_refused`` stops the run."""
        from forge.train.rollback import RollbackRequest

        if len(self.rollbacks) >= self.max_rollbacks:
            return f"{reason}; max_rollbacks ({self.max_rollbacks}) reached"
        step, name = state.global_step, detector.name

        def refused(why: str) -> None:
            self._stop(state, control, detector, step, value, f"{reason}; {why}")

        control.rollback = RollbackRequest(
            step=step,
            reason=f"{name}: {reason}",
            skip_past=self.skip_past,
            anchor_before=self.anchor_before,
            done=self._rolled_back,
            refused=refused,
        )
        if state.is_world_process_zero:
            logger.warning("divergence (%s) at step %d: %s; rolling back", name, step, reason)
        return None

    def _rolled_back(self, entry: dict[str, Any]) -> None:
        """After the restore (which gave this callback the anchor's state): the history of
        rollbacks goes on from before it."""
        self.rollbacks = [*self._history, entry]
        self.alarms = [False] * len(self.detectors)

    def unseen_eval_metrics(self, metrics: Collection[str]) -> list[str]:
        """The sanity pass's check: each evaluation metric a detector watches must be one the
        run's evaluation gives (``metrics``: what its evaluation batches produced)."""
        problems = []
        for detector in self.detectors:
            metric = detector.metric
            if metric.startswith("eval_") and metric not in metrics:
                problems.append(
                    f"{detector.name} watches {metric!r}, which the evaluation does not give "
                    f"(it gives {short_list(sorted(metrics))}){suggestion(metric, metrics)}"
                )
        return problems

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for detector, seen in zip(self.detectors, self.seen_metric, strict=True):
            if not seen:
                logger.warning(
                    "DivergenceDetector: %s watched %r, which was never logged; it checked "
                    "nothing (the logged metrics are those of metrics.jsonl)",
                    detector.name,
                    detector.metric,
                )

    def state_dict(self) -> dict[str, Any]:
        return {
            "detectors": [d.state_dict() for d in self.detectors],
            "alarms": list(self.alarms),
            "last_step": self.last_step,
            "rollbacks": list(self.rollbacks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("detectors", [])
        if len(saved) != len(self.detectors):
            logger.warning(
                "the checkpoint's DivergenceDetector had %d detector(s), this one has %d; "
                "they start fresh",
                len(saved),
                len(self.detectors),
            )
            return
        for detector, detector_state in zip(self.detectors, saved, strict=True):
            detector.load_state_dict(detector_state)
        self.alarms = [bool(a) for a in state.get("alarms", self.alarms)]
        self.last_step = int(state.get("last_step", 0))
        saved = list(state.get("rollbacks", []))
        # a restore for a rollback goes back to an anchor that knew fewer rollbacks: the history
        # is append-only, so the longer one is the run's
        self._history = saved if len(saved) >= len(self.rollbacks) else list(self.rollbacks)
        self.rollbacks = list(self._history)
