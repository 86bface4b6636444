"""The trainer callback a sweep trial trains with when its study prunes: at each evaluation
it reports the objective to the study, and when the study's pruner says so it has the loop save
a checkpoint at that step and stop. The worker then records the run as ``pruned``."""

from __future__ import annotations

import logging
from typing import Any

from forge.train import TrainerCallback

logger = logging.getLogger(__name__)


class PruningCallback(TrainerCallback):
    """Reports ``objective`` at every evaluation to trial ``trial_id`` of the study stored in
    ``storage``; ``pruned`` holds the step and value once the pruner stopped the trial."""

    def __init__(self, sweep: dict[str, Any]) -> None:
        from forge.sweep.study import load_trial

        self.objective = sweep["objective"]
        self.trial = load_trial(sweep)
        self.pruned: dict[str, Any] | None = None

    def on_evaluate(self, args, state, control, metrics, **kwargs):
        value = (metrics or {}).get(self.objective)
        if not isinstance(value, (int, float)):
            return
        step = state.global_step
        self.trial.report(float(value), step)
        if self.trial.should_prune():
            self.pruned = {"step": step, "value": float(value)}
            control.should_save = True  # the checkpoint at this step, as the issue asks
            control.should_training_stop = True
