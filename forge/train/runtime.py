"""What ``train()`` applies from the arguments before the first step: process-wide settings
(log levels), the step intervals of logging, evaluation and saving, and the loss naming of a
Hugging Face causal LM (the model's other settings are steps of the model-transform stage,
forge/train/transforms.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from forge.train.args import TrainingArguments

logger = logging.getLogger(__name__)

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


@dataclass(frozen=True)
class Intervals:
    """Every how many optimizer steps the loop logs, evaluates and saves (0: never by step)."""

    logging: int = 0
    eval: int = 0
    save: int = 0

    @classmethod
    def of(cls, args: TrainingArguments, max_steps: int) -> Intervals:
        """From the ``*_strategy`` / ``*_steps`` arguments (fractions of ``max_steps`` too)."""

        def every(strategy: str, name: str) -> int:
            return max(1, args.steps_for(name, max_steps)) if strategy == "steps" else 0

        return cls(
            logging=every(args.logging_strategy, "logging_steps"),
            eval=every(args.eval_strategy, "eval_steps"),
            save=every(args.save_strategy, "save_steps"),
        )

    def due(self, what: str, step: int) -> bool:
        every = getattr(self, what)
        return every > 0 and step % every == 0


def apply_runtime_settings(args: TrainingArguments, is_main: bool) -> None:
    """``log_level`` / ``log_level_replica`` (``tf32`` and ``full_determinism`` are applied,
    and put back, by ``forge.train.precision.numerics`` around ``train()``)."""
    level = args.log_level if is_main else args.log_level_replica
    if level != "passive":
        import transformers

        logging.getLogger("forge").setLevel(_LEVELS[level])
        transformers.logging.set_verbosity(_LEVELS[level])


def name_causal_lm_loss(model: nn.Module) -> None:
    """Name the loss of a Hugging Face causal LM whose class name maps to none.

    transformers picks a model's loss from its class name (``post_init`` sets ``loss_type``);
    a name such as ``GPT2LMHeadModel`` matches no entry of its ``LOSS_MAPPING``, so
    ``loss_type`` is None and the first loss warns "`loss_type=None` was set in the config but
    it is unrecognized. Using the default loss: `ForCausalLMLoss`" (once per process, so on
    every rank). For a decoder-only generative model that default is its loss: naming it
    (``loss_type``, transformers' own switch) keeps the loss and drops the warning. Any other
    model keeps its None, and the warning, which then says something.
    """
    from forge.train.loss import is_causal_lm
    from forge.wrappers import unwrap_model

    model = unwrap_model(model, through_adapters=True)
    if getattr(model, "loss_type", "") is not None or not is_causal_lm(model):
        return
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # transformers before the loss mapping: no such warning either
        return
    if "ForCausalLM" in LOSS_MAPPING:
        model.loss_type = "ForCausalLM"
