"""HF TrainingArguments that change what the loop does: optimizers, schedules, when it logs
and evaluates, activation checkpointing, the model's use_cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge.train import Trainer, TrainerCallback, TrainingArgumentsError
from tests.train.common import TokenDataset, make_args, make_trainer


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.evals: list[int] = []
        self.lrs: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "train_runtime" not in logs:  # steps' logs, not the end-of-training summary
            self.logs.append(dict(logs, step=state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evals.append(state.global_step)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def run(tmp_path, train_size=64, eval_size=None, **overrides) -> tuple[Trainer, Record]:
    record = Record()
    trainer = make_trainer(
        make_args(tmp_path, **overrides),
        train_size=train_size,
        eval_size=eval_size,
        callbacks=[record],
    )
    trainer.train()
    return trainer, record


@pytest.mark.parametrize(
    ("optim", "optim_args", "kind", "settings"),
    [
        ("sgd", "momentum=0.9,nesterov=true", torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        ("rmsprop", "alpha=0.9", torch.optim.RMSprop, {"alpha": 0.9}),
        ("adagrad", None, torch.optim.Adagrad, {}),
        ("adamw_torch", None, torch.optim.AdamW, {"fused": None}),
        ("adamw_torch_fused", None, torch.optim.AdamW, {"fused": True}),
    ],
)
def test_optim_builds_the_torch_optimizer_hf_names(tmp_path, optim, optim_args, kind, settings):
    trainer, _ = run(tmp_path, max_steps=2, optim=optim, optim_args=optim_args, weight_decay=0.1)
    assert type(trainer.optimizer) is kind
    for key, value in settings.items():
        assert trainer.optimizer.defaults[key] == value
    decays = sorted({g["weight_decay"] for g in trainer.optimizer.param_groups})
    assert decays == [0.0, 0.1]  # no decay on norms and biases


def test_adafactor_is_transformers_adafactor(tmp_path):
    from transformers.optimization import Adafactor

    trainer, _ = run(tmp_path, max_steps=2, optim="adafactor")
    assert isinstance(trainer.optimizer, Adafactor)
    assert trainer.optimizer.defaults["relative_step"] is False


def test_cosine_with_restarts_takes_its_kwargs(tmp_path):
    _, record = run(
        tmp_path,
        max_steps=8,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2},
    )
    lrs = record.lrs  # the rate of the next step, after each of the 8
    assert lrs[3] == 1e-3 and lrs[2] < lrs[3]  # back up to the peak for the second cycle
    assert lrs[:3] == pytest.approx(lrs[4:7])


def test_eval_on_start_and_eval_delay(tmp_path):
    _, record = run(
        tmp_path,
        eval_size=8,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        eval_delay=4,
        eval_on_start=True,
    )
    assert record.evals == [0, 4, 6]


def test_eval_on_save_evaluates_before_every_checkpoint_and_stores_its_metrics(tmp_path):
    from forge.checkpoint import read_manifest
    from tests.train.common import checkpoint_dir

    _, record = run(
        tmp_path,
        eval_size=8,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=3,
        eval_on_save=True,
    )
    assert record.evals == [3, 4, 6]  # the saves' (3, 6) and the schedule's (4)
    for step in (3, 6):
        assert "eval_loss" in read_manifest(checkpoint_dir(tmp_path, step)).metrics
    with pytest.raises(TrainingArgumentsError, match="eval_on_save evaluates at every save, but"):
        make_args(tmp_path, eval_on_save=True)


@pytest.mark.parametrize(
    ("overrides", "steps"),
    [
        ({"logging_steps": 0.25}, [2, 4, 6, 8]),  # a fraction of max_steps
        ({"logging_strategy": "epoch"}, [4, 8]),  # 16 rows, batch 4: an epoch is 4 steps
        ({"logging_strategy": "no"}, []),
        ({"logging_steps": 3, "logging_first_step": True}, [1, 3, 6, 8]),  # 8: the rest
    ],
)
def test_when_the_loop_logs(tmp_path, overrides, steps):
    _, record = run(tmp_path, train_size=16, max_steps=8, **overrides)
    assert [log["step"] for log in record.logs] == steps


def test_include_num_input_tokens_seen(tmp_path):
    _, record = run(tmp_path, max_steps=2, logging_steps=1, include_num_input_tokens_seen=True)
    assert [log["num_input_tokens_seen"] for log in record.logs] == [64, 128]  # 4 x 16 tokens


def test_gradient_checkpointing_and_use_cache(tmp_path):
    trainer, _ = run(tmp_path, max_steps=2, gradient_checkpointing=True, use_cache=False)
    assert trainer.model.is_gradient_checkpointing
    assert trainer.model.config.use_cache is False


def test_gradient_checkpointing_needs_a_model_that_supports_it(tmp_path):
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, labels=None):
            return {"loss": self.weight + input_ids.float().mean() * 0}

    trainer = Trainer(
        Plain(), make_args(tmp_path, max_steps=1, gradient_checkpointing=True), TokenDataset(8)
    )
    with pytest.raises(TrainingArgumentsError, match="Plain has none"):
        trainer.train()


def test_ddp_arguments_reach_both_trainers_wrappers_only_when_set(tmp_path):
    """The plain trainer passes these to DistributedDataParallel, the Accelerate trainer to its
    DistributedDataParallelKwargs handler; unset ones keep torch's defaults."""
    from forge.train.args.accelerate import AccelTrainingArguments
    from forge.train.strategies.accelerate import Accelerate

    assert make_args(tmp_path).ddp_kwargs() == {}
    args = make_args(tmp_path, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=5)
    assert args.ddp_kwargs() == {"find_unused_parameters": True, "bucket_cap_mb": 5}

    accel_args = AccelTrainingArguments(
        output_dir=str(tmp_path), report_to="none", ddp_static_graph=True, ddp_timeout=60
    )
    strategy = Accelerate.__new__(Accelerate)  # only the arguments are read
    strategy.args = accel_args
    init, ddp = strategy.accelerate_kwargs()
    assert init.timeout.total_seconds() == 60
    assert ddp.static_graph is True and ddp.find_unused_parameters is False  # Accelerate's default
