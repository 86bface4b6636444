"""Fixtures for the checkpoint tests: where checkpoints go and a checkpoint factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint import CheckpointRegistry, CheckpointWriter, Component, ModelWeights, Scope
from forge.train.topology import Topology


class Value:
    """A checkpoint component holding a fixed state."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "run" / "checkpoints"


@pytest.fixture
def write_checkpoint(ckpt_dir: Path) -> Callable[..., Path]:
    """Write a small checkpoint at a step through the registry; return its path.

    Components: ``model`` (weights), ``training`` (shared: ``training.pt``) and ``data``
    (per rank: ``data-rank-00000.pt``)."""

    def write(step: int, *, model: nn.Module | None = None, loss: float = 1.0) -> Path:
        if model is None:
            torch.manual_seed(step)
            model = nn.Linear(8, 4)
        registry = CheckpointRegistry(Topology())
        registry.extend(
            [
                Component("model", ModelWeights(model), Scope.STAGE, weights=True),
                Component("training", Value({"step": step, "w": torch.arange(10)})),
                Component("data", Value({"position": step}), Scope.RANK),
            ]
        )
        with CheckpointWriter(ckpt_dir, step) as writer:
            registry.save(writer)
            writer.set_meta(epoch=0, metrics={"loss": loss})
        return writer.final_path

    return write
