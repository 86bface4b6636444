"""The loop's behaviour: skipping non-finite steps, clipping, schedules, eval, best model."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_utils import EvalLoopOutput

from forge.data import CausalLMCollator
from forge.train import EarlyStoppingCallback, Trainer, TrainerCallback
from tests.train.common import (
    StopAtStep,
    TokenDataset,
    checkpoint_dir,
    component_state,
    make_args,
    make_trainer,
    tiny_llama_init,
)


class Snapshots(TrainerCallback):
    """Weights and learning rate after every step."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.lrs: dict[int, float] = {}
        self.logs: list[dict] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.weights[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}
        self.lrs[state.global_step] = optimizer.param_groups[0]["lr"]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "train_runtime" not in logs:  # steps' logs, not the end-of-training summary
            self.logs.append(dict(logs, step=state.global_step))


class InfLossAtStep(Trainer):
    """Makes the loss infinite during the step that will become ``bad_step``."""

    bad_step = 6

    def compute_loss(self, model, batch):
        loss = super().compute_loss(model, batch)
        if self.state.global_step + 1 == self.bad_step:
            loss = loss * float("inf")
        return loss


def test_nonfinite_loss_skips_the_step_counts_and_logs_it(tmp_path):
    snaps = Snapshots()
    args = make_args(tmp_path, max_steps=8, logging_steps=1)
    trainer = make_trainer(args, trainer_cls=InfLossAtStep, callbacks=[snaps])
    trainer.train()
    assert trainer.state.nonfinite_skipped == 1
    for name, before in snaps.weights[5].items():
        assert torch.equal(before, snaps.weights[6][name]), name  # step 6 left weights alone
    assert any(not torch.equal(v, snaps.weights[7][k]) for k, v in snaps.weights[6].items())
    bad = next(log for log in snaps.logs if log["step"] == 6)
    assert bad["nonfinite_skipped"] == 1
    assert math.isnan(bad["loss"])  # no finite step in that logging window
    assert "nonfinite_skipped" not in next(log for log in snaps.logs if log["step"] == 7)
    # AdamW took 7 steps out of 8
    assert {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()} == {7}


def test_nonfinite_step_is_applied_when_skipping_is_off(tmp_path):
    args = make_args(tmp_path, max_steps=6, skip_nonfinite=False, max_grad_norm=None)
    trainer = make_trainer(args, trainer_cls=InfLossAtStep)
    trainer.train()
    assert trainer.state.nonfinite_skipped == 0
    weights = trainer.model.state_dict()["model.embed_tokens.weight"]
    assert not torch.isfinite(weights).all()


class RecordClippedNorm(Trainer):
    def optimizer_step(self):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.clipped_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        super().optimizer_step()


def test_gradients_are_clipped_to_max_grad_norm(tmp_path):
    snaps = Snapshots()
    args = make_args(tmp_path, max_steps=4, max_grad_norm=0.01, logging_steps=1)
    trainer = make_trainer(args, trainer_cls=RecordClippedNorm, callbacks=[snaps])
    trainer.clipped_norms = []
    trainer.train()
    assert len(trainer.clipped_norms) == 4
    assert all(n == pytest.approx(0.01, rel=1e-4) for n in trainer.clipped_norms)
    assert all(log["grad_norm"] > 0.1 for log in snaps.logs)  # the logged norm is pre-clip


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_schedule_warms_up_then_follows_its_shape(tmp_path, kind):
    snaps = Snapshots()
    base, warmup, total = 1e-3, 4, 12
    args = make_args(
        tmp_path, max_steps=total, warmup_steps=warmup, lr_scheduler_type=kind, learning_rate=base
    )
    make_trainer(args, callbacks=[snaps]).train()

    def expected(step: int) -> float:  # the learning rate of the step after ``step``
        if kind == "constant":
            return base
        if step < warmup:
            return base * step / warmup
        progress = (step - warmup) / (total - warmup)
        if kind == "linear":
            return base * (1 - progress)
        if kind == "cosine":
            return base * 0.5 * (1 + math.cos(math.pi * progress))
        return base

    for step in range(1, total + 1):
        assert snaps.lrs[step] == pytest.approx(expected(step), abs=1e-12), step


def test_warmup_ratio_is_a_fraction_of_the_steps(tmp_path):
    args = make_args(tmp_path, max_steps=10, warmup_ratio=0.25, learning_rate=1e-3)
    snaps = Snapshots()
    make_trainer(args, callbacks=[snaps]).train()
    assert snaps.lrs[1] == pytest.approx(1e-3 / 3)  # ceil(2.5) = 3 warmup steps
    assert snaps.lrs[3] == pytest.approx(1e-3)


def test_epochs_with_a_short_last_window_step_with_what_they_have(tmp_path):
    # 40 samples / batch 4 = 10 micro-batches; accumulation 4: windows of 4, 4, 2 -> 3 steps
    args = make_args(tmp_path, max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=4)
    trainer = make_trainer(args, train_size=40)
    output = trainer.train()
    assert output.global_step == 6
    assert trainer.state.epoch == 2.0
    assert trainer.state.tokens_seen == 2 * 40 * 16


def test_custom_optimizer_and_scheduler_callables(tmp_path):
    snaps = Snapshots()
    args = make_args(tmp_path, max_steps=3)
    trainer = make_trainer(
        args,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        lr_scheduler=lambda opt, n: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1)),
        callbacks=[snaps],
    )
    trainer.train()
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert snaps.lrs[2] == pytest.approx(0.5 / 3)


def test_default_optimizer_skips_weight_decay_on_norms_and_biases(tmp_path):
    trainer = make_trainer(make_args(tmp_path, max_steps=1, weight_decay=0.1))
    trainer.train()
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])  # RMSNorm weights


def test_model_init_is_seeded(tmp_path):
    a = make_trainer(make_args(tmp_path / "a", max_steps=1, learning_rate=0.0))
    b = make_trainer(make_args(tmp_path / "b", max_steps=1, learning_rate=0.0))
    a.train()
    b.train()
    for name, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[name]), name


def test_a_module_is_trained_in_place(tmp_path):
    model = tiny_llama_init()()
    before = model.model.embed_tokens.weight.detach().clone()
    trainer = Trainer(
        model, make_args(tmp_path, max_steps=2), TokenDataset(16), data_collator=CausalLMCollator()
    )
    trainer.train()
    assert trainer.model is model
    assert not torch.equal(before, model.model.embed_tokens.weight)


def test_a_model_without_loss_is_a_clear_error(tmp_path):
    trainer = Trainer(tiny_llama_init(), make_args(tmp_path, max_steps=1), TokenDataset(8))
    with pytest.raises(ValueError, match="returned no loss"):
        trainer.train()


class ScriptedEval(Trainer):
    """Evaluation that returns a scripted eval_loss per step (the model is not involved)."""

    losses: dict[int, float] = {}

    def evaluation_loop(self, dataset, description="eval", prediction_loss_only=None, **kwargs):
        loss = self.losses.get(self.state.global_step, 9.0)
        return EvalLoopOutput(None, None, {"eval_loss": loss}, len(dataset))


def scripted(losses: dict[int, float]) -> type[ScriptedEval]:
    return type("Scripted", (ScriptedEval,), {"losses": losses})


def test_best_checkpoint_is_tracked_and_never_rotated_away(tmp_path):
    args = make_args(
        tmp_path,
        max_steps=40,
        eval_strategy="steps",
        save_strategy="steps",
        save_steps=10,
        eval_steps=10,
        save_total_limit=2,
        metric_for_best_model="loss",
    )
    cls = scripted({10: 3.0, 20: 1.0, 30: 2.0, 40: 2.5})
    trainer = make_trainer(args, eval_size=8, trainer_cls=cls)
    trainer.train()
    assert args.metric_for_best_model == "eval_loss" and args.greater_is_better is False
    assert trainer.state.best_metric == 1.0
    assert trainer.state.best_checkpoint == str(checkpoint_dir(tmp_path, 20))
    remaining = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert remaining == ["checkpoint-000020", "checkpoint-000040"]


def test_load_best_model_at_end(tmp_path):
    args = make_args(
        tmp_path,
        max_steps=30,
        eval_strategy="steps",
        save_strategy="steps",
        save_steps=10,
        eval_steps=10,
        load_best_model_at_end=True,
    )
    trainer = make_trainer(args, eval_size=8, trainer_cls=scripted({10: 3.0, 20: 1.0, 30: 2.0}))
    trainer.train()
    best = load_file(checkpoint_dir(tmp_path, 20) / "model.safetensors")
    last = load_file(checkpoint_dir(tmp_path, 30) / "model.safetensors")
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in best.items())
    assert not all(torch.equal(state[k], v) for k, v in last.items())


EARLY = {5: 3.0, 10: 2.0, 15: 2.5, 20: 2.4, 25: 2.6, 30: 2.7, 35: 2.8}


def early_args(output_dir, **overrides):
    values = dict(
        max_steps=40,
        eval_strategy="steps",
        eval_steps=5,
        save_strategy="steps",
        save_steps=5,
        early_stopping_patience=2,
    )
    values.update(overrides)
    return make_args(output_dir, **values)


def test_early_stopping_stops_after_patience_evaluations(tmp_path):
    trainer = make_trainer(early_args(tmp_path), eval_size=8, trainer_cls=scripted(EARLY))
    assert any(isinstance(cb, EarlyStoppingCallback) for cb in trainer.callback_handler.callbacks)
    output = trainer.train()
    assert output.global_step == 20  # best at 10, no improvement at 15 and 20


def test_early_stopping_state_survives_resume(tmp_path):
    first = make_trainer(
        early_args(tmp_path), eval_size=8, trainer_cls=scripted(EARLY), callbacks=[StopAtStep(15)]
    )
    first.train()
    assert first.state.global_step == 15
    saved = component_state(checkpoint_dir(tmp_path, 15), "callbacks")
    assert saved["EarlyStoppingCallback"] == {
        "best": 2.0,
        "evals_without_improvement": 1,
    }
    resumed = make_trainer(early_args(tmp_path), eval_size=8, trainer_cls=scripted(EARLY))
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == 20  # a fresh counter would have run to 30


def test_evaluate_reports_mean_loss_without_touching_training_rng(tmp_path):
    trainer = make_trainer(make_args(tmp_path, max_steps=1), eval_size=20)
    metrics = trainer.evaluate()  # builds the (seeded) model first
    state = torch.get_rng_state()
    speed = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    again = trainer.evaluate()
    assert {k: again[k] for k in metrics if k not in speed} == {
        k: metrics[k] for k in metrics if k not in speed
    }
    # evaluation draws once from the global generator, as HF's evaluation loop does (its
    # DataLoader iterator's base seed), and leaves the rest of training's generator as it was
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(after, torch.get_rng_state())
    assert set(metrics) == {
        "eval_loss",
        "eval_perplexity",  # a causal LM
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
    }
    assert math.log(128) - 0.5 < metrics["eval_loss"] < math.log(128) + 0.5  # random init
    limited = make_trainer(make_args(tmp_path, max_steps=1, max_eval_batches=1), eval_size=20)
    assert limited.evaluate()["eval_loss"] != metrics["eval_loss"]


class AutocastProbe(Trainer):
    def compute_loss(self, model, batch):
        self.autocast_dtypes.add(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        )
        return super().compute_loss(model, batch)


def test_bf16_autocast_on_cpu(tmp_path):
    trainer = make_trainer(make_args(tmp_path, max_steps=3, bf16=True), trainer_cls=AutocastProbe)
    trainer.autocast_dtypes = set()
    output = trainer.train()
    assert trainer.autocast_dtypes == {torch.bfloat16}
    assert math.isfinite(output.training_loss)


def test_fp16_grad_scaler_state_is_checkpointed(tmp_path):
    args = make_args(tmp_path, max_steps=2, fp16=True, save_strategy="steps", save_steps=2)
    trainer = make_trainer(args)
    trainer.train()
    assert trainer.scaler is not None
    saved = component_state(checkpoint_dir(tmp_path, 2), "scaler")
    assert saved["scale"] == trainer.scaler.get_scale()


@pytest.mark.slow
def test_torch_compile(tmp_path):
    trainer = make_trainer(make_args(tmp_path, max_steps=3, torch_compile=True))
    output = trainer.train()
    assert output.global_step == 3 and math.isfinite(output.training_loss)


def test_the_final_checkpoint_carries_the_final_evaluation(tmp_path):
    from forge.checkpoint import read_manifest

    args = make_args(
        tmp_path,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        eval_strategy="steps",
        eval_steps=4,
    )
    make_trainer(args, eval_size=8).train()
    # step 6 is a save step but not an eval step: it is evaluated before it is saved
    assert "eval_loss" in read_manifest(checkpoint_dir(tmp_path, 6)).metrics
