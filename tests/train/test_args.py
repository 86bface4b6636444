"""TrainingArguments: HF's names and defaults, YAML-friendly values, and every problem
reported at once by its key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import transformers

from forge.train import TrainingArguments, TrainingArgumentsError
from forge.train.args import NOT_APPLICABLE, OPTIMIZERS, OTHER_HF_OPTIMIZERS, SCHEDULERS


def hf_fields() -> dict[str, object]:
    """Every init field of the installed transformers.Seq2SeqTrainingArguments (its
    TrainingArguments' and the generation ones), with its default."""
    out = {}
    for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_every_hf_name_is_a_field_with_hf_default():
    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    missing = sorted(set(hf_fields()) - set(ours))
    assert not missing, f"HF TrainingArguments names forge lacks: {missing}"
    args = TrainingArguments()
    differ = {}
    for name, default in hf_fields().items():
        value = getattr(args, name)
        if hasattr(default, "value"):  # HF's enums
            default = default.value
        if name == "output_dir":
            default = "trainer_output"  # HF sets it in __post_init__ too
        if name in ("disable_tqdm", "resume_from_checkpoint", "report_to", "debug"):
            continue  # normalised: None -> False, "none" -> (), "" stays
        if name in ("activation_checkpointing", "gradient_checkpointing"):
            default = False  # HF resolves None to False in __post_init__ as well
        if value != default:
            differ[name] = (value, default)
    assert not differ, f"defaults that differ from HF's: {differ}"
    assert args.report_to == ()


def test_hf_schedulers_and_optimizers_are_all_known():
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    assert set(SCHEDULERS) == {s.value for s in SchedulerType}
    assert set(OPTIMIZERS) | set(OTHER_HF_OPTIMIZERS) == {o.value for o in OptimizerNames}


def test_yaml_friendly_values_are_normalised(tmp_path):
    args = TrainingArguments(
        output_dir=tmp_path,  # a Path
        learning_rate="3e-4",  # YAML 1.1 reads 3e-4 as a string
        num_train_epochs=2,  # an int for a float
        max_steps=100.0,  # an integral float for an int
        report_to=["tensorboard"],  # a list for a tuple
        resume_from_checkpoint=Path("/x/checkpoint-000010"),
        lr_scheduler_kwargs='{"num_cycles": 2}',  # JSON in a string, as on HF's command line
        lr_scheduler_type="cosine_with_restarts",
        gradient_checkpointing=True,  # HF's older name
    )
    assert args.output_dir == str(tmp_path)
    assert args.learning_rate == 3e-4 and isinstance(args.learning_rate, float)
    assert args.num_train_epochs == 2.0 and isinstance(args.num_train_epochs, float)
    assert args.max_steps == 100 and isinstance(args.max_steps, int)
    assert args.report_to == ("tensorboard",)
    assert args.resume_from_checkpoint == "/x/checkpoint-000010"
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}
    assert args.activation_checkpointing is True
    assert TrainingArguments(report_to="none").report_to == ()
    assert "tensorboard" in TrainingArguments(report_to="all").report_to


def test_step_intervals_and_warmup_may_be_fractions():
    args = TrainingArguments(
        logging_steps=0.1, eval_strategy="steps", save_steps=0.25, warmup_steps=0.05
    )
    assert args.eval_steps == 0.1  # HF: eval_steps defaults to logging_steps
    assert args.steps_for("logging_steps", 95) == 10  # rounded up
    assert args.steps_for("save_steps", 100) == 25
    assert args.warmup_steps_for(200) == 10
    assert TrainingArguments(warmup_steps=7).warmup_steps_for(200) == 7
    assert TrainingArguments(warmup_ratio=0.1).warmup_steps_for(200) == 20
    with pytest.raises(TrainingArgumentsError, match="must be an integer when it is more than 1"):
        TrainingArguments(save_steps=2.5)


def test_save_top_k_needs_a_metric_and_a_positive_count():
    with pytest.raises(TrainingArgumentsError, match="save_top_k must be a positive integer"):
        TrainingArguments(save_top_k=0)
    with pytest.raises(TrainingArgumentsError, match="save_top_k is 3, but no metric ranks"):
        TrainingArguments(save_top_k=3)
    args = TrainingArguments(save_top_k=3, metric_for_best_model="loss", eval_strategy="steps")
    assert args.save_top_k == 3


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
            report_to=["jsonl"],
            adam_beta2=1.0,
            device="tpu",
            dataloader_drop_last="yes",
        )
    problems = info.value.problems
    text = str(info.value)
    expected = [
        "trainer.args.output_dir",
        "trainer.args.max_steps",
        "trainer.args.save_steps must be a positive integer, or a fraction of the training "
        'steps below 1 (got 0); set it or use save_strategy: "no"',
        "trainer.args.learning_rate must be a number >= 0.0 (got 'fast')",
        "trainer.args.lr_scheduler_type must be one of",
        "trainer.args.fp16 and bf16 are both true",
        "trainer.args.gradient_accumulation_steps",
        "trainer.args.report_to names 'jsonl', which is not an integration",
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


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"report_to": "wandb"}, "needs the wandb package, which is not installed; pip install"),
        ({"report_to": "comet_ml"}, "an HF integration forge has no callback for"),
        ({"optim": "adamw_bnb_8bit"}, "optim 'adamw_bnb_8bit' is not one forge builds"),
        ({"optim": "adamw"}, "optim must be one of"),
        ({"optim": "sgd", "optim_args": "momentum=0.9,moment=1"}, "'moment=1' is not KEY=VALUE"),
        ({"optim_args": "eps=1e-6"}, "has no effect on optim 'adamw_torch_fused'"),
        (
            {"lr_scheduler_type": "cosine_with_min_lr"},
            "needs lr_scheduler_kwargs with min_lr or min_lr_rate",
        ),
        ({"lr_scheduler_kwargs": {"num_cycles": 2}}, "which schedule 'linear' does not take"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, 'eval_strategy must not be "no"'),
        ({"save_strategy": "best"}, 'eval_strategy must not be "no" when save_strategy: "best"'),
        ({"push_to_hub": True}, "push_to_hub does not apply to forge: forge does not upload"),
        ({"deepspeed": "ds.json"}, "deepspeed does not apply to forge"),
        ({"group_by_length": True, "train_sampling_strategy": "sequential"}, "set one of them"),
        ({"max_tokens_per_batch": 0}, "max_tokens_per_batch must be"),
        ({"length_column_name": ""}, "length_column_name must be a column name"),
        ({"dataloader_prefetch_factor": 2}, "applies to worker processes"),
        ({"use_cpu": True, "device": "cuda"}, "use_cpu is true but device is 'cuda'"),
        ({"include_for_metrics": ["logits"]}, "include_for_metrics must be a list of"),
        ({"eval_strategy": "epoch", "load_best_model_at_end": True}, "must equal eval_strategy"),
        ({"save_strategy": True}, 'quote the word, e.g. save_strategy: "steps"'),
    ],
)
def test_values_hf_would_reject_or_forge_cannot_honour(values, fragment):
    with pytest.raises(TrainingArgumentsError) as info:
        TrainingArguments(**values)
    assert any(fragment in p for p in info.value.problems), info.value.problems


def test_an_unquoted_no_that_yaml_read_as_false_is_the_word_meant():
    """`--set trainer.args.eval_strategy=no` reaches the arguments as False (YAML 1.1)."""
    args = TrainingArguments(output_dir="out", eval_strategy=False, save_strategy=False)
    assert (args.eval_strategy, args.save_strategy) == ("no", "no")


def test_accepted_hf_settings():
    args = TrainingArguments(
        optim="sgd",
        optim_args="momentum=0.9, nesterov=true",
        lr_scheduler_type="reduce_lr_on_plateau",
        eval_strategy="steps",
        use_cpu=True,
        torch_compile_mode="reduce-overhead",
        include_num_input_tokens_seen=True,
        save_only_model=True,
        ignore_data_skip=True,
        save_strategy="best",
        metric_for_best_model="accuracy",
    )
    assert args.parsed_optim_args() == {"momentum": 0.9, "nesterov": True}
    assert args.metric_for_best_model == "eval_accuracy" and args.greater_is_better is True
    assert args.device == "cpu" and args.torch_compile is True
    assert args.include_num_input_tokens_seen == "all"
    assert not args.save_optimizer_state and not args.save_rng_state  # save_only_model
    assert args.restore_dataloader_state is False  # ignore_data_skip
    for name, (accepted, _) in NOT_APPLICABLE.items():
        TrainingArguments(**{name: accepted[0]})  # the default of a name that does not apply


def test_strategy_dependent_checks():
    TrainingArguments(output_dir="o", save_strategy="no", save_steps=0, eval_strategy="no")
    with pytest.raises(TrainingArgumentsError, match="eval_steps must be a positive integer"):
        TrainingArguments(output_dir="o", eval_strategy="steps", eval_steps=-1)


def test_best_model_settings():
    args = TrainingArguments(output_dir="o", metric_for_best_model="accuracy")
    assert args.metric_for_best_model == "eval_accuracy" and args.greater_is_better is True
    args = TrainingArguments(output_dir="o", load_best_model_at_end=True, eval_strategy="steps")
    assert args.metric_for_best_model == "eval_loss" and args.greater_is_better is False
    assert TrainingArguments(metric_for_best_model="eval_nll_loss").greater_is_better is False
    with pytest.raises(TrainingArgumentsError) as info:
        TrainingArguments(
            output_dir="o",
            load_best_model_at_end=True,
            eval_strategy="steps",
            save_steps=10,
            eval_steps=4,
            early_stopping_patience=0,
        )
    problems = "\n".join(info.value.problems)
    assert "trainer.args.save_steps must be a multiple of eval_steps" in problems
    assert "trainer.args.early_stopping_patience must be a positive integer (got 0)" in problems
    with pytest.raises(TrainingArgumentsError, match='eval_strategy must not be "no"'):
        TrainingArguments(output_dir="o", early_stopping_patience=2, eval_strategy="no")
    # save_strategy "best" needs no alignment with the evaluation steps
    TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", save_strategy="best")


def test_config_check_reports_literal_values_and_skips_computed_ones():
    found = TrainingArguments.forge_check_values(
        {"save_steps": 0, "optim": "adamw_bnb_8bit", "output_dir": None}, ["output_dir"]
    )
    assert [name for name, _ in found] == ["optim", "save_steps"]
    assert all(message.startswith(f"trainer.args.{name} ") for name, message in found)
    assert TrainingArguments.forge_check_values({"max_steps": 5}, ["learning_rate"]) == []


def test_trainer_needs_an_eval_dataset_for_evaluations(tmp_path):
    from tests.train.common import make_args, make_trainer

    args = make_args(
        tmp_path, eval_strategy="steps", save_strategy="steps", early_stopping_patience=1
    )
    with pytest.raises(TrainingArgumentsError, match="trainer.eval_dataset is required") as info:
        make_trainer(args)
    assert any('set eval_strategy: "no"' in p for p in info.value.problems)
