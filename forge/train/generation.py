"""Evaluation that generates, with the semantics of Hugging Face's ``Seq2SeqTrainer``.

With ``predict_with_generate`` an evaluation (and a prediction) calls the model's ``generate``
on each batch and hands ``compute_metrics`` the generated ids in place of the logits; the loss
is still the model's forward with the labels. The keywords of ``generate`` are the ones
``evaluate``/``predict`` were given, else ``generation_max_length`` (as ``max_length``, unless
``max_new_tokens`` is given) and ``generation_num_beams`` (as ``num_beams``); the rest comes from
the model's ``generation_config``, which ``generation_config`` replaces when the model is built.
Each batch's generated ids, and its labels, are padded with the pad id (the tokenizer's, else its
end-of-sequence id, else the model config's) to the generation config's ``max_length`` (or
``max_new_tokens + 1``), and batches of other lengths are then padded with -100 when they are
concatenated, as HF pads them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge.checkpoint import unwrap_model
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.wrappers import class_label

#: the inputs that are the labels again, shifted: generation starts from the decoder's start
_DECODER_INPUTS = ("decoder_input_ids", "decoder_attention_mask")


def generation_kwargs(args: TrainingArguments, given: Mapping[str, Any]) -> dict[str, Any]:
    """``generate``'s keywords: ``given`` (what ``evaluate``/``predict`` were called with),
    completed by ``generation_max_length`` and ``generation_num_beams``."""
    kwargs = dict(given)
    if (
        kwargs.get("max_length") is None
        and kwargs.get("max_new_tokens") is None
        and args.generation_max_length is not None
    ):
        kwargs["max_length"] = args.generation_max_length
    if kwargs.get("num_beams") is None and args.generation_num_beams is not None:
        kwargs["num_beams"] = args.generation_num_beams
    return {k: v for k, v in kwargs.items() if not (k in ("max_length", "num_beams") and v is None)}


def load_generation_config(args: TrainingArguments) -> Any:
    """``generation_config`` as a checked ``transformers.GenerationConfig`` (None when unset):
    a directory holding ``generation_config.json``, such a file, a mapping of its settings,
    or a ``GenerationConfig``."""
    from transformers import GenerationConfig

    value, key = args.generation_config, f"{args.config_key}.generation_config"
    if value is None:
        return None
    try:
        if isinstance(value, GenerationConfig):
            config = copy.deepcopy(value)
        elif isinstance(value, Mapping):
            config = GenerationConfig(**value)
        elif Path(value).is_file():
            config = GenerationConfig.from_pretrained(Path(value).parent, Path(value).name)
        elif Path(value).is_dir():
            config = GenerationConfig.from_pretrained(value)
        else:
            raise TrainingArgumentsError(
                [
                    f"{key} is {value!r}, which is no directory or file; give a directory holding "
                    "generation_config.json, the file itself, or a mapping of generation settings"
                ]
            )
        config.validate(strict=True)
    except TrainingArgumentsError:
        raise
    except (OSError, ValueError, TypeError) as error:
        raise TrainingArgumentsError(
            [f"{key} is not a usable generation config: {error}"]
        ) from None
    return config


def prepare_model(model: nn.Module, args: TrainingArguments, config: Any) -> None:
    """Give the model ``generation_config`` (as HF's Seq2SeqTrainer does when it is made), and
    check that it can generate when evaluation will."""
    base = unwrap_model(model)
    if config is not None:
        base.generation_config = copy.deepcopy(config)
    if args.predict_with_generate and not callable(getattr(base, "generate", None)):
        raise TrainingArgumentsError(
            [
                f"{args.config_key}.predict_with_generate is true, but the model "
                f"({class_label(base)}) has no generate(); evaluate a transformers model that "
                "generates (GenerationMixin) or set it to false"
            ]
        )


def generation_step(
    trainer: Any,
    model: nn.Module,
    batch: Mapping[str, Any],
    labels: Any,
    gen_kwargs: Mapping[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor, Any]:
    """One evaluation batch, generating: (its mean loss or None without labels, the generated
    ids, the labels), both padded to the generation config's length."""
    generator = unwrap_model(trainer.model)
    kwargs = dict(gen_kwargs) if gen_kwargs else dict(trainer._gen_kwargs)
    kwargs = {
        k: v for k, v in kwargs.items() if not (k in ("max_length", "num_beams") and v is None)
    }
    # a sharded model's forward gathers parameters with every rank: all generate in step
    kwargs.setdefault("synced_gpus", trainer.strategy.collective_forward)
    inputs = dict(batch)
    decoder_ids = inputs.get("decoder_input_ids")
    label_ids = inputs.get("labels")
    if (
        isinstance(decoder_ids, torch.Tensor)
        and isinstance(label_ids, torch.Tensor)
        and decoder_ids.shape == label_ids.shape
    ):
        inputs = {k: v for k, v in inputs.items() if k not in _DECODER_INPUTS}
    with trainer.strategy.autocast():
        generated = generator.generate(**inputs, **kwargs)
    config = generator.generation_config
    if getattr(config, "_from_model_config", False):  # as HF: the model's own from now on
        config._from_model_config = False
    defaults = getattr(config, "_get_default_generation_params", None)
    if callable(defaults):  # transformers 5: the lengths generate fell back to, made explicit
        config.update(**defaults(), defaults_only=True)
    length = _padded_length(config, generated.shape[-1])
    pad_id = _pad_token_id(trainer, generator) if length else None
    if length:
        generated = _pad(generated, length, pad_id)
    loss = None
    if labels is not None:
        loss, _ = trainer.strategy.forward_eval(
            batch, lambda: trainer._forward_eval(model, batch, labels)
        )
    if isinstance(labels, torch.Tensor):
        length = _padded_length(config, labels.shape[-1])
        if length:
            pad_id = _pad_token_id(trainer, generator) if pad_id is None else pad_id
            labels = _pad(labels, length, pad_id)
    return loss, generated, labels


def _padded_length(config: Any, length: int) -> int:
    """The length ids of ``length`` are padded to (0: none), as HF's Seq2SeqTrainer pads."""
    if length < config.max_length:
        return config.max_length
    if config.max_new_tokens is not None and length < config.max_new_tokens + 1:
        return config.max_new_tokens + 1
    return 0


def _pad_token_id(trainer: Any, model: nn.Module) -> int:
    tokenizer = trainer.tokenizer
    if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
        found = tokenizer.pad_token_id
        return found if found is not None else tokenizer.eos_token_id
    found = getattr(getattr(model, "config", None), "pad_token_id", None)
    if found is None:
        raise TrainingArgumentsError(
            [
                f"{trainer.args.config_key}.predict_with_generate pads the generated ids with "
                "the pad token id, but neither the tokenizer nor the model's config has one; set "
                "pad_token_id in the model's config or give the trainer a tokenizer"
            ]
        )
    return found


def _pad(ids: torch.Tensor, length: int, pad_id: int) -> torch.Tensor:
    padded = torch.full((ids.shape[0], length), pad_id, dtype=ids.dtype, device=ids.device)
    padded[:, : ids.shape[-1]] = ids
    return padded
