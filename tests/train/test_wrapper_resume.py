"""Every wrapper forge offers, and a user's own, saved and resumed bit for bit.

A model reaches the trainer inside wrappers (LossAdapter, a user's module that keeps its layers as
``self.module``, peft's LoRA model) and is wrapped again by the strategy (DDP, FSDP2, Accelerate,
pipeline stages). The weights, the optimizer state (keyed by parameter name) and the moving
average are saved under names those wrappers leave, and must be found again under the same rule
when the run resumes: for each, 8 steps straight and 4 + a resume to 8 give bit-identical
weights and optimizer state. The DDP and FSDP cases run two real processes under torchrun.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from forge.data import CausalLMCollator, TupleCollator
from forge.train import AccelTrainer, LossAdapter, PipelineTrainer, Trainer
from tests.train.common import (
    StopAtStep,
    TokenDataset,
    assert_same_training,
    make_args,
    run_torchrun,
    tiny_llama_init,
)


class Net(nn.Module):
    """A plain-PyTorch regression model whose forward returns its loss as a bare tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x).squeeze(-1), y)


class UserWrapper(nn.Module):
    """A user's own wrapper that keeps the model it wraps as ``self.module``, with a trainable
    weight of its own beside it (which a checkpoint must hold too)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = Net()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        return {"loss": self.scale * self.module(x, y)}


class Pairs(Dataset):
    """64 items, as dicts or as (x, y) tuples."""

    def __init__(self, tuples: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=generator)
        self.y = torch.randn(64, generator=generator)
        self.tuples = tuples

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        if self.tuples:
            return self.x[index], self.y[index]
        return {"x": self.x[index], "y": self.y[index]}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


# name: (trainer class, model builder, dataset, collator, extra trainer arguments)
WRAPPERS = {
    "LossAdapter": (Trainer, functools.partial(LossAdapter, Net), Pairs(), None, {}),
    "tuple batches": (
        Trainer,
        functools.partial(LossAdapter, Net),
        Pairs(tuples=True),
        TupleCollator(["x", "y"]),
        {},
    ),
    "a user's wrapper of self.module": (Trainer, UserWrapper, Pairs(), None, {}),
    "LoRA (peft)": (
        Trainer,
        tiny_llama_init(),
        TokenDataset(64),
        CausalLMCollator(pad_token_id=0),
        {"peft_config": lora_config},
    ),
    "Accelerate": (AccelTrainer, functools.partial(LossAdapter, Net), Pairs(), None, {}),
    "pipeline stages": (
        PipelineTrainer,
        tiny_llama_init(),
        TokenDataset(64),
        CausalLMCollator(pad_token_id=0),
        {},
    ),
}


def train(output_dir: Path, name: str, stop_at: int | None = None, resume: bool = False):
    """8 steps (checkpoints every 4), or stopped after ``stop_at`` as a kill would."""
    trainer_cls, model, dataset, collator, extra = WRAPPERS[name]
    extra = {k: v() if callable(v) and k == "peft_config" else v for k, v in extra.items()}
    args = make_args(
        output_dir,
        max_steps=8,
        save_strategy="steps",
        save_steps=4,
        per_device_train_batch_size=8,
        ema_decay=0.9,  # the moving average is saved by parameter name too
    )
    callbacks = [StopAtStep(stop_at)] if stop_at else []
    trainer = trainer_cls(
        model, args, dataset, data_collator=collator, callbacks=callbacks, **extra
    )
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_every_wrapper_resumes_bit_for_bit(name, tmp_path):
    from forge.train.ema import moving_average

    straight = train(tmp_path / "straight", name)
    train(tmp_path / "run", name, stop_at=4)
    resumed = train(tmp_path / "run", name, resume=True)
    assert resumed.state.resumed_from is not None and resumed.state.global_step == 8
    assert_same_training(straight, resumed)
    assert torch.equal(
        torch.cat([t.flatten() for t in moving_average(straight).shadow]),
        torch.cat([t.flatten() for t in moving_average(resumed).shadow]),
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_wrapped_model_resumes_bit_for_bit_on_two_processes(strategy, tmp_path):
    script = Path(__file__).with_name("wrapper_resume_script.py")
    output = run_torchrun(script, str(tmp_path), strategy)
    assert "identical" in output, output
