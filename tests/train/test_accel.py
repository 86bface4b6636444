"""The Accelerate trainer in one process: the same training as the plain trainer, its own
arguments checked, its state in the shared checkpoint layer."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from forge.checkpoint import read_manifest
from forge.data import CausalLMCollator
from forge.train import AccelTrainer, AccelTrainingArguments, Trainer, TrainingArgumentsError
from tests.train.common import (
    TokenDataset,
    assert_same_training,
    checkpoint_dir,
    make_args,
    make_trainer,
)


def accel_args(output_dir: Path, **overrides) -> AccelTrainingArguments:
    own = {
        k: overrides.pop(k)
        for k in ("mixed_precision", "dispatch_batches", "split_batches")
        if k in overrides
    }
    return AccelTrainingArguments(**make_args(output_dir, **overrides).to_dict(), **own)


def logged_losses(output_dir: Path) -> list[float]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [row["loss"] for row in map(json.loads, lines) if "loss" in row]


def test_same_losses_step_for_step_as_the_plain_trainer(tmp_path):
    settings = dict(max_steps=14, logging_steps=1, gradient_accumulation_steps=3, train_size=40)
    train_size = settings.pop("train_size")  # 10 batches: windows of 3, 3, 3, 1 per epoch
    plain = make_trainer(make_args(tmp_path / "plain", **settings), train_size=train_size)
    plain.train()
    accel = make_trainer(
        accel_args(tmp_path / "accel", **settings), train_size=train_size, trainer_cls=AccelTrainer
    )
    accel.train()
    a, b = logged_losses(tmp_path / "plain"), logged_losses(tmp_path / "accel")
    assert len(a) == len(b) == 14
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6
    for (name, p), q in zip(plain.model.named_parameters(), accel.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name


def test_exact_resume_in_one_process(tmp_path):
    from forge.train import TrainingInterrupted
    from tests.train.common import SignalAtStep

    settings = dict(max_steps=12, save_strategy="steps", save_steps=4)
    straight = make_trainer(accel_args(tmp_path / "straight", **settings), trainer_cls=AccelTrainer)
    straight.train()
    first = make_trainer(
        accel_args(tmp_path / "resumed", **settings),
        trainer_cls=AccelTrainer,
        callbacks=[SignalAtStep(6)],
    )
    with pytest.raises(TrainingInterrupted):
        first.train()
    resumed = make_trainer(
        accel_args(tmp_path / "resumed", **settings, resume_from_checkpoint=True),
        trainer_cls=AccelTrainer,
    )
    resumed.train()
    assert resumed.state.resumed_from.endswith("checkpoint-000006")
    assert_same_training(straight, resumed)
    manifest = read_manifest(checkpoint_dir(tmp_path / "resumed", 12))
    assert manifest.trainer == "accelerate"


def test_checkpoints_move_between_the_plain_and_the_accelerate_trainer(tmp_path):
    settings = dict(max_steps=8, save_strategy="steps", save_steps=2)
    straight = make_trainer(make_args(tmp_path / "straight", **settings))
    straight.train()
    half = checkpoint_dir(tmp_path / "straight", 4)
    # one process on both sides, so the data position and random state carry over too
    accel = make_trainer(
        accel_args(tmp_path / "accel", **settings, resume_from_checkpoint=str(half)),
        trainer_cls=AccelTrainer,
    )
    accel.train()
    assert_same_training(straight, accel)
    back = make_trainer(
        make_args(
            tmp_path / "back",
            **settings,
            resume_from_checkpoint=str(checkpoint_dir(tmp_path / "accel", 6)),
        ),
        trainer_cls=Trainer,
    )
    back.train()
    assert_same_training(straight, back)


def test_mixed_precision_follows_bf16_and_conflicts_are_named(tmp_path):
    assert accel_args(tmp_path, bf16=True).mixed_precision == "bf16"
    assert accel_args(tmp_path).mixed_precision == "no"
    with pytest.raises(TrainingArgumentsError) as err:
        accel_args(tmp_path, mixed_precision="fp16", bf16=True)
    assert "trainer.args.mixed_precision is 'fp16' but trainer.args.bf16 is true" in str(err.value)
    with pytest.raises(TrainingArgumentsError, match="trainer.args.mixed_precision"):
        accel_args(tmp_path, mixed_precision="fp8x")
    with pytest.raises(TrainingArgumentsError, match="dispatch_batches must be null or false"):
        accel_args(tmp_path, dispatch_batches=True)


def test_bf16_through_accelerate_trains(tmp_path):
    trainer = make_trainer(
        accel_args(tmp_path, max_steps=3, mixed_precision="bf16"), trainer_cls=AccelTrainer
    )
    output = trainer.train()
    assert output.global_step == 3 and torch.isfinite(torch.tensor(output.training_loss))


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        ({"ACCELERATE_USE_FSDP": "true"}, "turns on FSDP (ACCELERATE_USE_FSDP)"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "turns on DeepSpeed (ACCELERATE_USE_DEEPSPEED)"),
        (
            {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"},
            "parallelism_config has dp_shard_size 2",
        ),
    ],
)
def test_an_accelerate_config_that_shards_state_is_refused_when_built(
    tmp_path, monkeypatch, environment, named
):
    """forge's checkpoints hold the whole weights and optimizer state: a sharded run would
    save one shard (and DeepSpeed's clip gives no norm, so every step would be skipped)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TrainingArgumentsError) as refused:
        make_trainer(accel_args(tmp_path, max_steps=1), trainer_cls=AccelTrainer)
    message = str(refused.value)
    assert named in message
    assert "forge does not shard parameters or optimizer state yet" in message
    assert "train with DDP" in message


def test_accelerates_own_compile_is_refused_for_forges(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    with pytest.raises(TrainingArgumentsError, match="torch_compile: true"):
        make_trainer(accel_args(tmp_path, max_steps=1), trainer_cls=AccelTrainer)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # what `accelerate launch` passes
    make_trainer(accel_args(tmp_path, max_steps=1), trainer_cls=AccelTrainer)


def test_hfs_sharding_arguments_do_not_send_users_to_a_refused_config(tmp_path):
    for name, value in (
        ("fsdp", "full_shard"),
        ("deepspeed", "ds.json"),
    ):
        with pytest.raises(TrainingArgumentsError) as refused:
            accel_args(tmp_path, **{name: value})
        message = str(refused.value)
        assert "forge does not shard parameters or optimizer state yet" in message, name
        assert "accelerate config" not in message
    # fsdp_config alone: sharding is switched on by fsdp (in the plain trainer)
    with pytest.raises(TrainingArgumentsError, match="fsdp is not; set fsdp: full_shard"):
        accel_args(tmp_path, fsdp_config={"min_num_params": 1})


@pytest.mark.slow
def test_compiled_under_accelerate_the_checkpoint_keeps_the_models_names(tmp_path, monkeypatch):
    """torch.compile runs before prepare (the transform stage's order); the saved weights
    carry the model's own names, not the compiled wrapper's."""
    from safetensors.torch import load_file

    compile_eager = functools.partial(torch.compile, backend="eager")  # no C++ toolchain
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_eager(model))
    trainer = make_trainer(
        accel_args(tmp_path, max_steps=2, torch_compile=True, save_strategy="steps", save_steps=2),
        trainer_cls=AccelTrainer,
    )
    trainer.train()
    saved = load_file(checkpoint_dir(tmp_path, 2) / "model.safetensors")
    assert set(saved) == set(trainer.model.state_dict()) - {"lm_head.weight"} or set(saved) == set(
        trainer.model.state_dict()
    )


def test_activation_checkpointing_happens_before_prepare_and_trains_the_same(tmp_path):
    from tests.train.test_transforms import TinyLM, logged_losses, recomputed

    def trainer(name: str, trainer_cls, args_fn, **overrides):
        args = args_fn(tmp_path / name, max_steps=4, logging_steps=1, **overrides)
        return trainer_cls(TinyLM, args, TokenDataset(32), data_collator=CausalLMCollator(0))

    plain = trainer("plain", Trainer, make_args)
    plain.train()
    accel = trainer("accel", AccelTrainer, accel_args, activation_checkpointing=True)
    accel.train()
    assert recomputed(accel.model) == [1, 1, 1]
    losses = logged_losses(tmp_path / "plain")
    assert len(losses) == 4
    assert logged_losses(tmp_path / "accel") == pytest.approx(losses, abs=1e-6)  # as above
