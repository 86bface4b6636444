"""Fixtures for the checkpoint tests: where checkpoints go and a checkpoint factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from forge.checkpoint import CheckpointWriter


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "run" / "checkpoints"


@pytest.fixture
def write_checkpoint(ckpt_dir: Path) -> Callable[..., Path]:
    """Write a small checkpoint (plain model + training state) at a step; return its path."""

    def write(step: int, *, model: nn.Module | None = None, loss: float = 1.0) -> Path:
        if model is None:
            torch.manual_seed(step)
            model = nn.Linear(8, 4)
        with CheckpointWriter(ckpt_dir, step) as writer:
            writer.save_model(model)
            writer.save_torch("training_state.pt", {"step": step, "w": torch.arange(10)})
            writer.save_torch("rank_state_00000.pt", {"position": step})
            writer.set_meta(epoch=0, metrics={"loss": loss})
        return writer.final_path

    return write
