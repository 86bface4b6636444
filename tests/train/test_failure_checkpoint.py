"""No trained steps lost to a late failure (as Lightning's OnExceptionCheckpoint): a run that
fails between two optimizer steps (in an evaluation's metrics, in a callback) saves the last
completed step, which resumes bit for bit; a run that fails inside a step saves nothing new."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.checkpoint import find_checkpoints, validate_checkpoint
from forge.train import TrainerCallback
from tests.train.common import (
    assert_same_training,
    checkpoint_dir,
    make_args,
    make_trainer,
    run_torchrun,
)


class Failing:
    """compute_metrics that raises at the evaluation of step ``at`` (a metric's bug)."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.trainer = None

    def __call__(self, prediction):
        if self.trainer is not None and self.trainer.state.global_step == self.at:
            raise ZeroDivisionError("a metric divided by zero")
        return {"mean_logit": float(prediction.predictions.mean())}


def args_for(output_dir: Path, **overrides):
    values = dict(
        max_steps=12,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=100,  # no checkpoint before the end but the one a failure leaves
        logging_steps=2,
        max_eval_batches=1,
    )
    values.update(overrides)
    return make_args(output_dir, **values)


def train(output_dir: Path, fail_at: int | None, resume: bool = False, **overrides):
    metrics = Failing(fail_at)
    trainer = make_trainer(
        args_for(output_dir, **overrides), eval_size=8, compute_metrics=metrics, train_size=96
    )
    metrics.trainer = trainer
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def test_a_metric_that_fails_leaves_its_step_saved_and_resumable(tmp_path, caplog):
    straight = train(tmp_path / "straight", None)
    from forge.train.user_code import UserCodeFailure

    with pytest.raises(UserCodeFailure, match="ZeroDivisionError: a metric divided by zero"):
        train(tmp_path / "run", 6)
    saved = [info.path.name for info in find_checkpoints(tmp_path / "run" / "checkpoints")]
    assert saved == ["checkpoint-000006"]
    assert validate_checkpoint(checkpoint_dir(tmp_path / "run", 6)) == []
    assert "the run failed after step 6, which completed" in caplog.text
    resumed = train(tmp_path / "run", None, resume=True)
    assert resumed.state.resumed_from.endswith("checkpoint-000006")
    assert_same_training(straight, resumed)


class RaiseOnLog(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == 4:
            raise RuntimeError("the report writer broke")


def test_a_callback_that_fails_leaves_its_step_saved(tmp_path):
    trainer = make_trainer(args_for(tmp_path, eval_strategy="no"), callbacks=[RaiseOnLog()])
    with pytest.raises(RuntimeError, match="report writer"):
        trainer.train()
    assert validate_checkpoint(checkpoint_dir(tmp_path, 4)) == []


class BreaksInForward(TrainerCallback):
    """Makes the model's forward raise during step 5 (inside the step)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 4:

            def broken(*a, **k):
                raise RuntimeError("CUDA error: an illegal memory access")

            model.forward = broken


def test_a_failure_inside_a_step_saves_nothing_new(tmp_path, caplog):
    args = args_for(tmp_path, eval_strategy="no", save_steps=3)
    trainer = make_trainer(args, callbacks=[BreaksInForward()])
    with pytest.raises(RuntimeError, match="illegal memory access"):
        trainer.train()
    saved = [info.path.name for info in find_checkpoints(tmp_path / "checkpoints")]
    assert saved == ["checkpoint-000003"]  # step 4 completed, but the failure came after it
    assert "step 5 failed inside its forward, backward or optimizer step" in caplog.text


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("failing", ["both", "one"])
def test_two_ranks_save_after_a_failure_together_or_not_at_all(tmp_path, failing):
    """Both ranks fail in the metrics at step 6: both save it. Only rank 1 fails: rank 0 goes
    on into the next step's collective, so neither saves (rank 1 says why)."""
    script = Path(__file__).with_name("failure_checkpoint_script.py")
    output = run_torchrun(script, str(tmp_path), failing, timeout=600, expect_failure=True)
    saved = [info.path.name for info in find_checkpoints(tmp_path / "checkpoints")]
    if failing == "both":
        assert saved == ["checkpoint-000006"], output
    else:
        assert saved == [], output
        assert "another rank did not stop after step 6 with this one" in output
