"""Checkpoint components registered by a callback, run in-process or by torchrun from
test_components.py.

    python -m torch.distributed.run --nproc_per_node=N components_script.py OUT KIND [JSON]

KIND is ``pipeline`` or ``plain`` (tests/train/pipeline_script.py's tiny causal LM); JSON holds
``stop_at`` (stop after that step, with a checkpoint), ``resume`` (a checkpoint to resume from)
and other training arguments. Every rank leaves ``OUT/shadow-rank-R-begin.pt`` (its stage's
shadow weights once training begins, after a resume's restore) and ``-end.pt`` (at the end).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge.checkpoint import Component, Scope
from forge.train import TrainerCallback
from tests.train.common import StopAtStep
from tests.train.pipeline_script import train


class ShadowWeights:
    """An exponential moving average of one stage's parameters, keyed by parameter name, that
    moves only after an applied optimizer step (an EMA, as a stage-scoped component)."""

    def __init__(self, model: nn.Module, decay: float = 0.5) -> None:
        self.params = dict(model.named_parameters())
        self.shadow = {name: p.detach().clone() for name, p in self.params.items()}
        self.decay = decay
        self.updates = 0

    def on_optimizer_step(self, applied: bool) -> None:
        if not applied:
            return
        self.updates += 1
        with torch.no_grad():
            for name, param in self.params.items():
                self.shadow[name].lerp_(param, 1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Exactly this stage's names from a checkpoint of any split (merged by name)."""
        missing = sorted(self.shadow.keys() - state.keys())
        assert not missing, f"the checkpoint has no shadow weights for {missing}"
        for name, tensor in self.shadow.items():
            tensor.copy_(state[name])


class ShadowCallback(TrainerCallback):
    """Registers ``ShadowWeights`` of this rank's model with ``scope`` and writes them out."""

    def __init__(self, output_dir: str | Path | None = None, scope: Scope = Scope.STAGE) -> None:
        self.output_dir, self.scope = output_dir, scope
        self.weights: ShadowWeights | None = None
        self.at_begin: dict[str, torch.Tensor] = {}

    def on_register(self, args, state, control, register, model=None, **kwargs):
        self.weights = ShadowWeights(model)
        register(Component("shadow", self.weights, self.scope))

    def on_train_begin(self, args, state, control, **kwargs):
        self.at_begin = self.weights.state_dict()
        self._dump(state, "begin")

    def on_train_end(self, args, state, control, **kwargs):
        self._dump(state, "end")

    def _dump(self, state, tag: str) -> None:
        if self.output_dir is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            path = Path(self.output_dir) / f"shadow-rank-{rank}-{tag}.pt"
            torch.save({"step": state.global_step, **self.weights.state_dict()}, path)


def run(output_dir: str | Path, kind: str, **extra: Any):
    """``pipeline_script.train`` with the shadow callback, saving every ``stop_at`` steps."""
    callbacks: list[TrainerCallback] = [ShadowCallback(output_dir)]
    stop_at, resume = extra.pop("stop_at", None), extra.pop("resume", None)
    if stop_at:
        callbacks.append(StopAtStep(stop_at))
        extra.update(save_strategy="steps", save_steps=stop_at)
    if resume:
        extra["resume_from_checkpoint"] = resume
    return train(output_dir, kind, callbacks=callbacks, **extra)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1], sys.argv[2], **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
