"""The moving average of the weights (ema_decay): its arguments, its update rule, that a
skipped step leaves it alone, that it resumes exactly with every trainer, that eval_with_ema
evaluates with it without changing the training, and that export --ema writes it."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

from forge.checkpoint import CheckpointError, read_manifest
from forge.read.errors import ReadUsageError
from forge.read.reader import export_model
from forge.train import (
    AccelTrainer,
    PipelineTrainer,
    TrainerCallback,
    TrainingArguments,
    TrainingArgumentsError,
)
from forge.train.ema import WeightsEMA, moving_average, read_ema_state
from tests.train.common import (
    StopAtStep,
    assert_same_tensors,
    assert_same_training,
    checkpoint_dir,
    component_state,
    make_args,
    make_trainer,
)
from tests.train.components_script import run as run_script
from tests.train.test_components import InfLossAtStep, torchrun
from tests.train.test_pipeline import pipeline_args

EMA = {"ema_decay": 0.9}


# ------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ema_decay": 1.0}, "trainer.args.ema_decay must be a number in (0, 1) (got 1.0)"),
        ({"ema_decay": -0.5}, "trainer.args.ema_decay must be a number in (0, 1) (got -0.5)"),
        ({"ema_decay": "high"}, "trainer.args.ema_decay must be a number in (0, 1) (got 'high')"),
        (
            {"ema_decay": 0.9, "ema_warmup_steps": -1},
            "trainer.args.ema_warmup_steps must be a non-negative integer (got -1)",
        ),
        (
            {"ema_decay": 0.9, "ema_update_every": 0},
            "trainer.args.ema_update_every must be a positive integer (got 0)",
        ),
        ({"eval_with_ema": True}, "trainer.args.eval_with_ema evaluates with the moving average"),
    ],
)
def test_bad_ema_arguments_are_refused_by_key(values, message):
    with pytest.raises(TrainingArgumentsError) as err:
        TrainingArguments(**values)
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems
    # and the config check finds them before anything is built, located by argument
    found = TrainingArguments.forge_check_values(values)
    assert any(message in text for _, text in found), found


def test_ema_is_off_by_default_and_zero_turns_it_off():
    assert TrainingArguments().ema_decay is None
    assert TrainingArguments(ema_decay=0).ema_decay is None
    assert TrainingArguments(ema_decay="0.999").ema_decay == 0.999  # YAML 1.1 strings


# ------------------------------------------------------------------------- the update rule


def test_the_update_follows_the_documented_formula_with_warmup_and_update_every():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # frozen: not averaged
    ema = WeightsEMA(model, 0.9, warmup_steps=4, update_every=2)
    assert set(ema.state_dict()["weights"]) == {"weight"}
    expected = model.weight.detach().clone()
    assert torch.equal(ema.shadow[0], expected)  # before any update: the starting weights
    for step in range(1, 9):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        ema.on_optimizer_step(applied=True)
        if step % 2 == 0:
            decay = 0.9 * min(1.0, (step - 1) / 4)
            expected = decay * expected + (1 - decay) * model.weight.detach()
        torch.testing.assert_close(ema.shadow[0], expected, rtol=0, atol=1e-6)
    assert (ema.steps, ema.updates) == (8, 4)
    before = ema.shadow[0].clone()
    ema.on_optimizer_step(applied=False)  # a skipped step: nothing moves, nothing counts
    assert torch.equal(ema.shadow[0], before) and ema.steps == 8


def test_the_average_is_fp32_on_the_parameters_device_for_a_bf16_model():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    ema = WeightsEMA(model, 0.5)
    assert all(
        s.dtype == torch.float32 and s.device == p.device
        for s, (_, p) in zip(ema.shadow, ema.params, strict=True)
    )
    with torch.no_grad():
        model.weight.add_(1)
    ema.on_optimizer_step(applied=True)
    kept = model.weight.detach().clone()
    with ema.swapped_in():
        assert model.weight.dtype == torch.bfloat16
        assert torch.equal(model.weight, ema.shadow[0].to(torch.bfloat16))
    assert torch.equal(model.weight, kept)  # put back bit for bit


def test_tied_weights_are_averaged_once_and_saved_under_each_name():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    ema = WeightsEMA(model, 0.9)
    assert len(ema.shadow) == 1
    weights = ema.state_dict()["weights"]
    assert set(weights) == {"0.weight", "1.weight"} and weights["0.weight"] is weights["1.weight"]


def test_stage_shards_merge_by_name_into_another_split():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    whole = WeightsEMA(model, 0.5)
    for _ in range(3):
        with torch.no_grad():
            model[1].weight.mul_(2)
        whole.on_optimizer_step(applied=True)
    state = whole.state_dict()
    first = {**state, "weights": {k: v for k, v in state["weights"].items() if k < "1"}}
    last = {**state, "weights": {k: v for k, v in state["weights"].items() if k >= "1"}}
    again = WeightsEMA(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 0.5)
    again.load_state_dict(WeightsEMA.reshard([first, last]))
    assert_same_tensors(again.state_dict(), state, "ema")
    with pytest.raises(CheckpointError, match="has no average of 1.weight, 1.bias"):
        again.load_state_dict(first)
    with pytest.raises(CheckpointError, match="counted other steps"):
        WeightsEMA.reshard([first, {**last, "steps": 2}])


# ------------------------------------------------------------------------- in training


def test_a_skipped_step_leaves_the_average_unchanged(tmp_path):
    """Step 3's loss is infinite: its optimizer step is skipped, and so is the average's."""
    seen = {}

    class Watch(InfLossAtStep):
        def _optimizer_stepped(self, applied):
            before = [t.clone() for t in moving_average(self).shadow]
            super()._optimizer_stepped(applied)
            seen[self.state.global_step + 1] = all(
                torch.equal(a, b) for a, b in zip(before, moving_average(self).shadow, strict=True)
            )

    args = make_args(tmp_path, max_steps=5, max_grad_norm=None, **EMA)
    trainer = make_trainer(args, trainer_cls=Watch)
    trainer.train()
    assert seen == {1: False, 2: False, 3: True, 4: False, 5: False}
    assert (moving_average(trainer).steps, moving_average(trainer).updates) == (4, 4)
    assert trainer.state.nonfinite_skipped == 1


def test_the_average_resumes_exactly_with_the_plain_trainer(tmp_path):
    args = functools.partial(make_args, max_steps=8, save_strategy="steps", save_steps=4, **EMA)
    straight = make_trainer(args(tmp_path / "straight", ema_warmup_steps=3))
    straight.train()
    make_trainer(args(tmp_path / "run", ema_warmup_steps=3), callbacks=[StopAtStep(4)]).train()
    ckpt = checkpoint_dir(tmp_path / "run", 4)
    assert read_manifest(ckpt).components["ema"] == {
        "scope": "stage", "weights": False, "files": ["ema.pt"],
    }  # fmt: skip
    saved = component_state(ckpt, "ema")
    assert (saved["steps"], saved["updates"]) == (4, 4)
    assert all(t.dtype == torch.float32 for t in saved["weights"].values())
    resumed = make_trainer(
        args(tmp_path / "run", ema_warmup_steps=3, resume_from_checkpoint=str(ckpt))
    )
    resumed.train()
    assert_same_training(straight, resumed)
    assert_same_tensors(
        moving_average(straight).state_dict(), moving_average(resumed).state_dict(), "ema"
    )


def test_a_checkpoint_without_an_average_starts_it_from_the_restored_weights(tmp_path, caplog):
    make_trainer(make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)).train()
    ckpt = checkpoint_dir(tmp_path, 2)
    args = make_args(tmp_path, max_steps=2, resume_from_checkpoint=str(ckpt), **EMA)
    trainer = make_trainer(args)
    with caplog.at_level("WARNING"):
        trainer.train()  # at its end already: restores, trains nothing
    assert "has no 'ema' component; it starts fresh" in caplog.text
    assert moving_average(trainer).steps == 0
    for (_, param), shadow in zip(
        moving_average(trainer).params, moving_average(trainer).shadow, strict=True
    ):
        assert torch.equal(param.detach(), shadow)


def test_the_average_resumes_exactly_with_the_accelerate_trainer(tmp_path):
    args = functools.partial(make_args, max_steps=6, save_strategy="steps", save_steps=3, **EMA)
    straight = make_trainer(args(tmp_path / "straight"), trainer_cls=AccelTrainer)
    straight.train()
    make_trainer(
        args(tmp_path / "run"), trainer_cls=AccelTrainer, callbacks=[StopAtStep(3)]
    ).train()
    ckpt = checkpoint_dir(tmp_path / "run", 3)
    resumed = make_trainer(
        args(tmp_path / "run", resume_from_checkpoint=str(ckpt)), trainer_cls=AccelTrainer
    )
    resumed.train()
    assert_same_tensors(
        moving_average(straight).state_dict(), moving_average(resumed).state_dict(), "ema"
    )


def test_the_average_resumes_exactly_under_the_pipeline_trainer_in_one_process(tmp_path):
    """The pipeline trainer on one process (all stages in it); the torchrun test runs two."""
    extra = {**EMA, "ema_warmup_steps": 2, "save_final_checkpoint": True}
    straight = run_script(tmp_path / "straight", "pipeline", **extra)
    run_script(tmp_path / "run", "pipeline", stop_at=3, **extra)
    ckpt = checkpoint_dir(tmp_path / "run", 3)
    resumed = run_script(tmp_path / "run", "pipeline", resume=str(ckpt), **extra)
    assert moving_average(resumed).steps == 6
    assert_same_tensors(
        moving_average(straight).state_dict(), moving_average(resumed).state_dict(), "ema"
    )
    # the pipeline's checkpoint loads into the plain trainer's model by name (export --ema)
    assert set(read_ema_state(checkpoint_dir(tmp_path / "run", 6))) >= {
        "model.embed_tokens.weight",
        "model.norm.weight",
    }


# ------------------------------------------------------------------------- eval_with_ema


class EvalLosses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.losses.append(metrics["eval_loss"])


def test_eval_with_ema_reports_the_averages_loss_and_leaves_training_unchanged(tmp_path):
    """Two runs that differ only in eval_with_ema train bit-identically; their evaluations
    differ, and the EMA run's best checkpoint is chosen by the average's loss."""
    common = dict(
        max_steps=8, eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4,
        metric_for_best_model="loss", ema_decay=0.8,
    )  # fmt: skip
    runs, evals = {}, {}
    for with_ema in (False, True):
        args = make_args(tmp_path / str(with_ema), eval_with_ema=with_ema, **common)
        record = EvalLosses()
        trainer = make_trainer(args, eval_size=16, callbacks=[record])
        trainer.train()
        runs[with_ema], evals[with_ema] = trainer, record.losses
    plain, averaged = runs[False], runs[True]
    assert_same_training(plain, averaged)
    assert_same_tensors(
        moving_average(plain).state_dict(), moving_average(averaged).state_dict(), "ema"
    )
    assert len(evals[True]) == len(evals[False]) >= 2
    assert all(a != b for a, b in zip(evals[True], evals[False], strict=True))
    # evaluating the model with the average swapped in by hand gives the reported number
    with moving_average(plain).swapped_in():  # the same weights and average as the other run's
        by_hand = plain.evaluate()["eval_loss"]
    assert by_hand == pytest.approx(averaged.evaluate()["eval_loss"], abs=0)
    assert averaged.state.best_metric == min(evals[True])


@pytest.mark.parametrize("with_ema", [False, True])
def test_the_log_says_the_average_is_on_and_which_weights_evaluation_uses(
    tmp_path, caplog, with_ema
):
    args = make_args(
        tmp_path, max_steps=2, ema_decay=0.9, ema_warmup_steps=5, ema_update_every=2,
        eval_with_ema=with_ema,
    )  # fmt: skip
    trainer = make_trainer(args)
    with caplog.at_level(logging.INFO, logger="forge.train.ema"):
        trainer.train()
    count = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    [line] = [r.getMessage() for r in caplog.records if r.name == "forge.train.ema"]
    assert line.startswith(
        f"moving average of the weights (EMA) of {count:,} trainable parameters: decay 0.9, "
        "warmup 5 steps, updated every 2 applied optimizer steps"
    ), line
    if with_ema:
        assert line.endswith("evaluation and the best checkpoint use the average (eval_with_ema)")
    else:
        assert line.endswith("evaluation uses the trained weights (eval_with_ema: false)")


def test_load_best_model_at_end_with_eval_with_ema_loads_the_best_average(tmp_path):
    args = make_args(
        tmp_path, max_steps=8, eval_strategy="steps", eval_steps=4, save_strategy="steps",
        save_steps=4, load_best_model_at_end=True, eval_with_ema=True, ema_decay=0.8,
    )  # fmt: skip
    trainer = make_trainer(args, eval_size=16)
    trainer.train()
    best = read_ema_state(trainer.state.best_checkpoint)
    for names, param in moving_average(trainer).params:
        assert torch.equal(param.detach(), best[names[0]].to(param.dtype))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric)


# ------------------------------------------------------------------------- export --ema


def test_export_ema_writes_the_average_and_refuses_a_checkpoint_without_one(tmp_path):
    from transformers import AutoModelForCausalLM

    args = make_args(tmp_path / "run", max_steps=4, **EMA)
    trainer = make_trainer(args)
    trainer.train()
    ckpt = checkpoint_dir(tmp_path / "run", 4)
    export_model(ckpt, tmp_path / "ema", ema=True)
    export_model(ckpt, tmp_path / "raw")
    average = moving_average(trainer).state_dict()["weights"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ema")
    raw = AutoModelForCausalLM.from_pretrained(tmp_path / "raw")
    for name, param in loaded.named_parameters():
        assert torch.equal(param, average[name]), name
        assert not torch.equal(param, dict(raw.named_parameters())[name]), name

    make_trainer(make_args(tmp_path / "plain", max_steps=2)).train()
    with pytest.raises(ReadUsageError, match="holds no moving average of the weights"):
        export_model(checkpoint_dir(tmp_path / "plain", 2), tmp_path / "none", ema=True)
    assert not (tmp_path / "none").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_the_average_resumes_exactly_under_ddp(tmp_path):
    """The plain trainer on 2 processes (DDP, gloo): stopped at step 3 and resumed to 6, the
    average ends where a straight run's ends, bit for bit; rank 0 writes the one file."""
    extra = {**EMA, "save_final_checkpoint": True}
    torchrun(tmp_path / "straight", "plain", **extra)
    torchrun(tmp_path / "run", "plain", stop_at=3, **extra)
    ckpt = checkpoint_dir(tmp_path / "run", 3)
    assert read_manifest(ckpt).components["ema"]["files"] == ["ema.pt"]
    assert component_state(ckpt, "ema")["steps"] == 3
    torchrun(tmp_path / "run", "plain", resume=str(ckpt), **extra)
    straight = component_state(checkpoint_dir(tmp_path / "straight", 6), "ema")
    resumed = component_state(checkpoint_dir(tmp_path / "run", 6), "ema")
    assert resumed["steps"] == 6
    assert_same_tensors(straight, resumed, "ema")


def test_eval_with_ema_under_the_pipeline_trainer_swaps_the_stages_weights(tmp_path):
    """The pipeline's stages run on the model's own parameters: the average is swapped into
    them for evaluation and out again, so training is the same and the loss is another."""
    common = dict(max_steps=4, eval_strategy="steps", eval_steps=2, ema_decay=0.5)
    runs = {}
    for with_ema in (False, True):
        args = pipeline_args(tmp_path / str(with_ema), eval_with_ema=with_ema, **common)
        trainer = make_trainer(args, eval_size=16, trainer_cls=PipelineTrainer)
        runs[with_ema] = (trainer, trainer.train())
    (plain, plain_out), (averaged, averaged_out) = runs[False], runs[True]
    assert_same_tensors(plain.stage_state_dict(), averaged.stage_state_dict(), "weights")
    assert averaged_out.metrics["eval_loss"] != plain_out.metrics["eval_loss"]
