"""Padding-free packing: a batch's sequences concatenated into one row, kept apart by
``position_ids`` that restart at 0 for each sequence (Hugging Face's
``DataCollatorWithFlattening``, TRL's ``padding_free``).

Such a batch trains correctly only where the model's attention keeps each token to its own
sequence. In transformers 5, a causal LM's mask (``masking_utils.create_causal_mask``) does so
from the restarting ``position_ids`` for the ``eager``, ``sdpa``, ``flex_attention`` and
``flash_attention_*`` implementations, but only when the batch has no ``attention_mask`` and
the forward builds no cache (``use_cache`` off: a cache turns the detection off silently). A
model that would attend across the sequences is refused before training with the reason:

- ``packing_refusal``: what is known of the model without running it (its forward, its
  attention implementation, ``use_cache``, the trainer);
- ``packing_leak``: the proof, run by the sanity pass on the real model and the first batch:
  the logits of the packed sequences must equal those of each sequence run alone.

Labels are separated by the collator (each sequence's first label is -100), so the loss, the
label-token count ``num_items_in_batch`` and the token count (``input_ids``, no padding) need
nothing of their own; ``sequence_count`` gives the items a packed batch holds.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from forge.wrappers import class_label

logger = logging.getLogger(__name__)

#: a model class that keeps packed sequences apart itself says so with this attribute
SUPPORTS_PACKED = "supports_packed_sequences"

PAD = "pad instead of packing (data_collator: !singleton:forge.data:CausalLMCollator {pad_token_id: 0})"
FIX = (
    "train a transformers causal LM (Llama, GPT-2, ...) with attn_implementation sdpa, eager, "
    f"flex_attention or flash_attention_2, or {PAD}"
)


def restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a new sequence starts inside a row (not counting the row's first token): the
    positions whose ``position_ids`` do not follow the one before, as transformers'
    ``find_packed_sequence_indices`` reads them."""
    return position_ids[..., 1:] != position_ids[..., :-1] + 1


def is_packed_batch(batch: Mapping[str, Any]) -> bool:
    """Whether a row of ``batch`` holds more than one sequence (its ``position_ids`` restart)."""
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return False
    return bool(restarts(positions).any())


def sequence_count(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The sequences (items) a batch with 2-d ``position_ids`` holds: its rows plus the
    restarts inside them, as a tensor where the positions are (counting never waits for the
    device); None for a batch without ``position_ids``."""
    positions = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return None
    return restarts(positions).sum() + positions.shape[0]


def packs_sequences(collator: Any) -> bool:
    """Whether ``collator`` makes packed batches: transformers' ``DataCollatorWithFlattening``
    (with its ``position_ids``) or a collator with TRL's ``padding_free`` on; looked at through
    forge's column filter (its ``collator``)."""
    while collator is not None:
        if getattr(collator, "padding_free", False) is True:
            return True
        if type(collator).__name__ == "DataCollatorWithFlattening":
            return bool(getattr(collator, "return_position_ids", True))
        collator = getattr(collator, "collator", None)
    return False


def packing_refusal(
    model: nn.Module | type,
    *,
    use_cache: bool = False,
    batch_keys: Any = (),
    trainer_reason: str | None = None,
) -> tuple[str, str] | None:
    """Why ``model`` (an instance, or a class when no instance can be built) would attend
    across the sequences of a packed batch, as far as that is known without running it; None
    when nothing says so. ``use_cache``: the trainer's ``use_cache`` (the model's config takes
    it); ``batch_keys``: the packed batch's keys; ``trainer_reason``: why the trainer cannot
    keep packed sequences apart, where it cannot. Returns the message and what to do."""
    from forge.checkpoint import unwrap_model

    if isinstance(model, nn.Module):
        model = unwrap_model(model, through_adapters=True)
    cls = model if isinstance(model, type) else type(model)
    label = class_label(cls)
    found = _reason(model, cls, use_cache, set(batch_keys), trainer_reason)
    if found is None:
        return None
    reason, fix = found
    return f"{label} would attend across the sequences of a packed batch: {reason}", fix


def _reason(
    model: Any, cls: type, use_cache: bool, keys: set[str], trainer_reason: str | None
) -> tuple[str, str] | None:
    if trainer_reason:
        return trainer_reason, f"train with the plain, Accelerate or FSDP trainer, or {PAD}"
    if not _takes_position_ids(cls):
        return (
            "its forward takes no position_ids, so the restarting positions that mark where "
            "each sequence starts never reach its attention"
        ), FIX
    if "attention_mask" in keys:
        return (
            "the batches also hold an attention_mask, from which transformers builds the mask "
            "instead of from position_ids (it then masks padding only)"
        ), "drop attention_mask from the collator's output"
    if getattr(cls, SUPPORTS_PACKED, False):
        return None
    from transformers import PreTrainedModel

    if not issubclass(cls, PreTrainedModel):
        return (
            "it is no transformers model, and nothing says its attention keeps to the "
            "sequences position_ids mark; a model whose attention does says so with the class "
            f"attribute {SUPPORTS_PACKED} = True (the sanity pass then checks it)"
        ), FIX
    config = getattr(model, "config", None) if not isinstance(model, type) else None
    if config is not None:
        if getattr(config, "is_encoder_decoder", False) or not getattr(config, "is_causal", True):
            return "it is no causal LM; packed batches are for a causal LM's causal mask", PAD
        implementation = getattr(config, "_attn_implementation", None)
        masked = _packed_mask_implementations()
        if implementation is not None and masked and implementation not in masked:
            return (
                f"its attention implementation {implementation!r} builds no mask from "
                f"position_ids (transformers does for {', '.join(sorted(masked))})"
            ), f"set attn_implementation: sdpa in the model's config, or {PAD}"
    if use_cache:
        return (
            "use_cache is on (trainer.args.use_cache: true), and with a cache transformers "
            "builds no per-sequence mask from position_ids"
        ), "set trainer.args.use_cache: false (the default)"
    return None


def _takes_position_ids(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # no signature to read: the sanity pass's probe decides
    return any(
        p.name == "position_ids" or p.kind is p.VAR_KEYWORD
        for p in parameters
        if p.kind is not p.VAR_POSITIONAL
    )


def _packed_mask_implementations() -> set[str]:
    """The attention implementations whose mask transformers builds per packed sequence."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:  # transformers before its masking utilities
        return set()
    return set(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)


def packing_leak(model: nn.Module, batch: Mapping[str, Any], sequences: int = 3) -> str | None:
    """The proof that ``model`` keeps packed sequences apart: the first ``sequences`` sequences
    of ``batch``'s first packed row, run packed and each alone (eval mode, no gradients, the
    model's own dtype); a message naming the model and the difference when their logits differ
    by more than float noise, None when they agree (or the model returns no logits)."""
    from forge.checkpoint import unwrap_model

    model = unwrap_model(model, through_adapters=True)
    ids, positions = batch["input_ids"], batch["position_ids"]
    row = int(restarts(positions).any(dim=-1).nonzero()[0])
    starts = [0, *(restarts(positions[row]).nonzero().flatten() + 1).tolist()]
    ends = [*starts[1:], positions.shape[-1]][:sequences]
    starts = starts[: len(ends)]
    device = next(iter(model.parameters()), torch.empty(0)).device
    packed_ids = ids[row, : ends[-1]].to(device)[None]
    packed_positions = positions[row, : ends[-1]].to(device)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model(input_ids=packed_ids, position_ids=packed_positions))
            if packed is None:
                logger.debug("%s returns no logits: packing not checked", class_label(model))
                return None
            alone = torch.cat(
                [
                    _logits(
                        model(
                            input_ids=packed_ids[:, start:end],
                            position_ids=torch.arange(end - start, device=device)[None],
                        )
                    )[0]
                    for start, end in zip(starts, ends, strict=True)
                ]
            )
    finally:
        model.train(was_training)
    full_precision = packed.dtype == torch.float32
    packed, alone = packed[0].float(), alone.float()
    difference = float((packed - alone).abs().max())
    scale = max(float(alone.abs().max()), 1.0)
    tolerance = (1e-3 if full_precision else 5e-2) * scale
    if difference <= tolerance:
        return None
    lengths = ", ".join(str(end - start) for start, end in zip(starts, ends, strict=True))
    return (
        f"{class_label(model)} would attend across the sequences of a packed batch: the "
        f"logits of {len(ends)} packed sequences (lengths {lengths}) differ from those of each "
        f"run alone by up to {difference:.3g} (tolerance {tolerance:.3g})"
    )


def _logits(outputs: Any) -> torch.Tensor | None:
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    return logits if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None
