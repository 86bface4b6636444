"""Batch collation: causal language modelling, and naming the parts of tuple items."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


class TupleCollator:
    """Names the parts of tuple items, so a dataset written for plain PyTorch or Lightning
    (``__getitem__`` returns ``(inputs, target)``) feeds ``model(**batch)``.

    ``TupleCollator(["features", "labels"])`` turns each item ``(x, y)`` into
    ``{"features": x, "labels": y}`` and collates the dicts with torch's default collation
    (which stacks tensors key by key); items that are dicts already pass as they are. With a
    ``collator`` of your own (one that takes the tuple items and returns a tuple batch), the
    items go to it unchanged and the parts of the batch it returns are named. In a config::

        data_collator: &data_collator !singleton:forge.data:TupleCollator
            names: [features, labels]
    """

    def __init__(
        self, names: Sequence[str], collator: Callable[[list[Any]], Any] | None = None
    ) -> None:
        names = [names] if isinstance(names, str) else list(names or [])
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(
                f"TupleCollator names must be a list of batch keys, one per part of an item "
                f"(got {names!r}), e.g. names: [features, labels]"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"TupleCollator names repeat a key: {names}")
        if collator is not None and not callable(collator):
            raise TypeError(
                f"TupleCollator collator must be callable (got {type(collator).__name__})"
            )
        self.names = names
        self.collator = collator

    def __call__(self, items: Sequence[Any]) -> Any:
        from torch.utils.data import default_collate

        if self.collator is None:
            return default_collate([self._named(item, "item") for item in items])
        return self._named(self.collator(items), "batch")

    def _named(self, parts: Any, what: str) -> Any:
        if isinstance(parts, Mapping) or not isinstance(parts, (tuple, list)):
            return parts
        if len(parts) != len(self.names):
            raise ValueError(
                f"TupleCollator names {len(self.names)} parts ({', '.join(self.names)}) but "
                f"an {what} has {len(parts)}; give one name per part"
            )
        return dict(zip(self.names, parts, strict=True))

    def __repr__(self) -> str:
        inner = f", collator={self.collator!r}" if self.collator is not None else ""
        return f"TupleCollator(names={self.names!r}{inner})"


def tuple_collator_hint(size: int, forward_names: Sequence[str]) -> str:
    """The config line that names a batch of ``size``-part tuples, with the model's forward
    parameter names where there are enough of them (``labels`` for a missing last one)."""
    names = list(forward_names[:size])
    while len(names) < size:
        names.append("labels" if "labels" not in names else f"part{len(names)}")
    return f"data_collator: !singleton:forge.data:TupleCollator {{names: [{', '.join(names)}]}}"


class ItemsBatch(dict):
    """A collated batch that keeps the items it was collated from (``KeepItems``): a part of
    it can then be collated from its share of the items, as a smaller batch would be (its own
    padding width), rather than cut out of the collated tensors."""

    def __init__(self, batch: Mapping[str, Any] = (), items: Sequence[Any] = ()) -> None:
        super().__init__(batch)
        self.source_items = list(items)

    def __reduce__(self) -> tuple:  # from a loader worker to the main process, items included
        return (ItemsBatch, (dict(self), self.source_items))


class KeepItems:
    """``collate`` (torch's default collation when None), whose mapping batches keep their
    items (``ItemsBatch``); ``auto_find_batch_size`` collates its smaller pieces from them."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        from torch.utils.data import default_collate

        self.collate = collate if collate is not None else default_collate

    def __call__(self, items: list[Any]) -> Any:
        batch = self.collate(items)
        return ItemsBatch(batch, items) if isinstance(batch, Mapping) else batch
