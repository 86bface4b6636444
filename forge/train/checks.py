"""What a trainer refuses when it is built: arguments of the wrong kind, arguments its strategy
cannot honour, settings that need an evaluation dataset it was not given, and callbacks whose
settings cannot work with the arguments (their ``check_arguments``). Each message names the
argument (``trainer.X``, or the config key of ``args``) and what to do."""

from __future__ import annotations

from typing import Any

from torch import nn

from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.wrappers import class_label

#: why LoRA and FSDP (``fsdp`` set) are refused together
LORA_UNDER_FSDP = (
    "LoRA is not supported under fsdp yet: the adapter checkpoint (peft's one adapter file, "
    "written by rank 0) is not written from the sharded parameters FSDP leaves each rank, so "
    "the run's first save would fail. Train LoRA with DDP (fsdp: null): the frozen base has "
    "no gradients or optimizer state, so it usually fits where the full model needed sharding"
)


def check_trainer_arguments(
    model: Any, args: Any, unsupported: dict[str, str], **given: Any
) -> None:
    """``model`` and ``args`` of the right kind, one tokenizer, functions where functions are
    expected, nothing the trainer's strategy cannot honour (``unsupported``: argument ->
    reason). ``given`` holds the other constructor arguments by name."""
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"trainer.args must be TrainingArguments (got {type(args).__name__})")
    if not isinstance(model, nn.Module) and not callable(model):
        raise TypeError(
            "trainer.model must be an nn.Module or a callable that builds one "
            f"(got {class_label(model)})"
        )
    if given.get("processing_class") is not None and given.get("tokenizer") is not None:
        raise TypeError(
            "trainer got both tokenizer and processing_class (HF 5's name for it); pass one"
        )
    for name in ("compute_metrics", "preprocess_logits_for_metrics", "compute_loss_func"):
        value = given.get(name)
        if value is not None and not callable(value):
            raise TypeError(
                f"trainer.{name} must be a function (got {type(value).__name__}); in a config "
                f"write it as !partial:./metrics.py:{name} []"
            )
        if value is not None and name in unsupported:
            raise TrainingArgumentsError([f"trainer.{name}: {unsupported[name]}"])
    if given.get("peft_config") is not None and "peft_config" in unsupported:
        raise TrainingArgumentsError([f"trainer.peft_config: {unsupported['peft_config']}"])
    if given.get("peft_config") is not None and args.fsdp_settings() is not None:
        raise TrainingArgumentsError([f"trainer.peft_config: {LORA_UNDER_FSDP}"])


def check_eval_dataset(args: TrainingArguments, eval_dataset: Any) -> None:
    """The settings that evaluate need an evaluation dataset."""
    if eval_dataset is not None:
        return
    needs = [
        name
        for name, on in (
            ("eval_strategy", args.eval_strategy != "no"),
            ("load_best_model_at_end", args.load_best_model_at_end),
            ("early_stopping_patience", args.early_stopping_patience is not None),
        )
        if on
    ]
    if needs:
        raise TrainingArgumentsError(
            [
                f"trainer.eval_dataset is required by {args.config_key}.{name}; pass an "
                + (
                    'eval dataset or set eval_strategy: "no"'
                    if name == "eval_strategy"
                    else f"eval dataset or unset {name}"
                )
                for name in needs
            ]
        )


def check_callbacks(args: TrainingArguments, eval_dataset: Any, callbacks: list[Any]) -> None:
    """Each callback's own ``check_arguments(args, evaluates)`` (a list of problems, e.g. a
    divergence detector on a metric this run never logs), all reported together."""
    evaluates = eval_dataset is not None and args.eval_strategy != "no"
    problems = []
    for index, callback in enumerate(callbacks):
        check = getattr(callback, "check_arguments", None)
        if callable(check):
            where = f"trainer.callbacks[{index}] ({type(callback).__name__})"
            problems += [f"{where}: {problem}" for problem in check(args, evaluates)]
    if problems:
        raise TrainingArgumentsError(problems)
