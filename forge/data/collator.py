"""Batch collation for causal language modelling."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class CausalLMCollator:
    """Pads items on the right into ``{"input_ids", "attention_mask", "labels"}``.

    Items are mappings with ``input_ids`` (a 1-d tensor or list) and optionally ``labels``.
    Labels default to the inputs; padded positions get ``label_pad_id`` so the loss ignores
    them. Padding is decided by position, never by token id, so ``pad_token_id`` may equal
    the eos id that separates packed documents. The model shifts labels itself.
    """

    def __init__(self, pad_token_id: int = 0, *, label_pad_id: int = -100) -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(
                f"pad_token_id must be a non-negative token id (got {pad_token_id!r}); "
                "use the tokenizer's pad_token_id"
            )
        self.pad_token_id = pad_token_id
        self.label_pad_id = label_pad_id

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not items:
            raise ValueError("CausalLMCollator got an empty batch")
        inputs = [_as_ids(item["input_ids"], "input_ids") for item in items]
        labels = [
            _as_ids(item["labels"], "labels") if "labels" in item else ids
            for item, ids in zip(items, inputs, strict=True)
        ]
        for ids, lab in zip(inputs, labels, strict=True):
            if lab.shape != ids.shape:
                raise ValueError(f"labels length {lab.numel()} != input_ids length {ids.numel()}")
        width = max(ids.numel() for ids in inputs)
        batch = torch.full((len(items), width), self.pad_token_id, dtype=torch.long)
        label_batch = torch.full((len(items), width), self.label_pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, (ids, lab) in enumerate(zip(inputs, labels, strict=True)):
            n = ids.numel()
            batch[row, :n] = ids
            label_batch[row, :n] = lab
            mask[row, :n] = 1
        return {"input_ids": batch, "attention_mask": mask, "labels": label_batch}

    def __repr__(self) -> str:
        return (
            f"CausalLMCollator(pad_token_id={self.pad_token_id}, label_pad_id={self.label_pad_id})"
        )


def _as_ids(value: Any, name: str) -> torch.Tensor:
    ids = torch.as_tensor(value, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"each item's {name} must be 1-d (got shape {tuple(ids.shape)})")
    return ids
