"""A pipeline trainer whose stage 1 is SIGKILLed in the middle of a save (copied into a test
project as killer.py and chosen with -D trainer_class=./killer.py:KillableTrainer).

The save of step $FORGE_TEST_DIE_AT kills stage 1's process after it has written its weight
and optimizer shards, before rank 0 can commit the checkpoint.
"""

from __future__ import annotations

import os
import signal

from forge.checkpoint import Component
from forge.train import PipelineTrainer


class DiesDuringSave:
    """A checkpoint component, registered last, whose state_dict() kills stage 1."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        trainer = self.trainer
        step = str(trainer.state.global_step)
        if trainer.topology.stage == 1 and step == os.environ.get("FORGE_TEST_DIE_AT"):
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class KillableTrainer(PipelineTrainer):
    def register_components(self) -> None:
        super().register_components()
        self.register(Component("dies", DiesDuringSave(self)))
