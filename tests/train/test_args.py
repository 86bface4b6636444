"""TrainingArguments: YAML-friendly values, and every problem reported at once by its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.train import TrainingArguments, TrainingArgumentsError


def test_defaults_are_valid_and_hf_named(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path))
    assert args.max_steps == -1 and args.num_train_epochs == 1.0
    assert args.lr_scheduler_type == "linear"
    assert args.eval_steps == args.save_steps  # evaluate where checkpoints are written
    assert args.report_to == ("progress", "jsonl", "tensorboard")


def test_yaml_friendly_values_are_normalised(tmp_path):
    args = TrainingArguments(
        output_dir=tmp_path,  # a Path
        learning_rate="3e-4",  # YAML 1.1 reads 3e-4 as a string
        num_train_epochs=2,  # an int for a float
        max_steps=100.0,  # an integral float for an int
        report_to=["jsonl"],  # a list for a tuple
        resume_from_checkpoint=Path("/x/checkpoint-000010"),
    )
    assert args.output_dir == str(tmp_path)
    assert args.learning_rate == 3e-4 and isinstance(args.learning_rate, float)
    assert args.num_train_epochs == 2.0 and isinstance(args.num_train_epochs, float)
    assert args.max_steps == 100 and isinstance(args.max_steps, int)
    assert args.report_to == ("jsonl",)
    assert args.resume_from_checkpoint == "/x/checkpoint-000010"
    assert TrainingArguments(output_dir="o", report_to="none").report_to == ()
    assert TrainingArguments(output_dir="o", report_to="all").report_to == args.__class__.report_to


def test_every_problem_is_listed_with_its_key_value_and_fix():
    with pytest.raises(TrainingArgumentsError) as info:
        TrainingArguments(
            output_dir="",
            max_steps=0,
            save_steps=0,
            learning_rate="fast",
            lr_scheduler_type="exp",
            bf16=True,
            fp16=True,
            gradient_accumulation_steps=0,
            report_to=["wandb"],
            adam_beta2=1.0,
            device="tpu",
            dataloader_drop_last="yes",
        )
    problems = info.value.problems
    text = str(info.value)
    expected = [
        "trainer.args.output_dir",
        "trainer.args.max_steps",
        "trainer.args.save_steps must be a positive integer (got 0); "
        'set it or use save_strategy: "no"',
        "trainer.args.learning_rate must be a number >= 0.0 (got 'fast')",
        "trainer.args.lr_scheduler_type must be one of",
        "trainer.args.fp16 and bf16 are both true",
        "trainer.args.gradient_accumulation_steps",
        "trainer.args.report_to has unknown reporters ['wandb']",
        "trainer.args.adam_beta2",
        "trainer.args.device",
        "trainer.args.dataloader_drop_last must be true or false (got 'yes')",
    ]
    for fragment in expected:
        assert any(fragment in p for p in problems), fragment
    assert len(problems) == len(expected)
    assert all(p.startswith("trainer.args.") for p in problems)
    assert f"({len(expected)})" in text
    assert isinstance(info.value, ValueError)


def test_strategy_dependent_checks():
    TrainingArguments(output_dir="o", save_strategy="no", save_steps=0, eval_strategy="no")
    with pytest.raises(TrainingArgumentsError, match="eval_steps must be a positive integer"):
        TrainingArguments(output_dir="o", eval_steps=0)


def test_best_model_settings(tmp_path):
    args = TrainingArguments(output_dir="o", metric_for_best_model="accuracy")
    assert args.metric_for_best_model == "eval_accuracy" and args.greater_is_better is True
    args = TrainingArguments(output_dir="o", load_best_model_at_end=True)
    assert args.metric_for_best_model == "eval_loss" and args.greater_is_better is False
    with pytest.raises(TrainingArgumentsError) as info:
        TrainingArguments(
            output_dir="o",
            load_best_model_at_end=True,
            save_steps=10,
            eval_steps=4,
            early_stopping_patience=0,
        )
    problems = "\n".join(info.value.problems)
    assert "trainer.args.save_steps must be a multiple of eval_steps" in problems
    assert "trainer.args.early_stopping_patience must be a positive integer (got 0)" in problems
    with pytest.raises(TrainingArgumentsError, match='eval_strategy must not be "no"'):
        TrainingArguments(output_dir="o", early_stopping_patience=2, eval_strategy="no")
    with pytest.raises(TrainingArgumentsError, match="must equal eval_strategy"):
        TrainingArguments(output_dir="o", load_best_model_at_end=True, save_strategy="epoch")


def test_trainer_needs_an_eval_dataset_for_best_model_and_early_stopping(tmp_path):
    from tests.train.common import make_args, make_trainer

    args = make_args(
        tmp_path, eval_strategy="steps", save_strategy="steps", early_stopping_patience=1
    )
    with pytest.raises(TrainingArgumentsError, match="trainer.eval_dataset is required"):
        make_trainer(args)
