"""The loss of a training step: what the model returns, or what ``compute_loss_func`` or label
smoothing computes from its outputs, and how one optimizer step's micro-batches share it.

``TrainingLoss.compute`` is Hugging Face's ``Trainer.compute_loss`` (the trainer's
``compute_loss`` calls it, so a subclass that overrides that is honoured): with
``compute_loss_func`` or ``label_smoothing_factor`` the batch's ``labels`` are taken out and
the model gets the rest; then ``compute_loss_func(outputs, labels[, num_items_in_batch=])``, or
the smoothed cross-entropy of the logits, or the model's own ``.loss`` / ``["loss"]`` / first
element of a tuple. ``num_items_in_batch`` is HF's count of the label tokens of a whole
optimizer step, for a function that normalises by it. The model's own introspection the loss
needs (is it a causal LM, does its loss shift the labels, which batch keys are labels) is here
too.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from forge.train.plain_models import bare_tensor_message
from forge.wrappers import class_label, unwrap_model

IGNORE_INDEX = -100  # label value the loss skips; also the padding of gathered arrays


class TrainingLoss:
    """The loss of one batch and the step's ``num_items_in_batch`` for a trainer with
    ``compute_loss_func`` (or None) and ``args`` (``label_smoothing_factor``,
    ``average_tokens_across_devices``). ``warn(message, level=...)`` logs on rank 0."""

    def __init__(
        self, compute_loss_func: Callable[..., torch.Tensor] | None, args: Any, warn: Any
    ) -> None:
        self.func = compute_loss_func
        self.args = args
        self.warn = warn
        self.takes_items = compute_loss_func is not None and takes_keyword(
            compute_loss_func, "num_items_in_batch"
        )
        self.smoother = None
        if args.label_smoothing_factor:
            from transformers.trainer_pt_utils import LabelSmoother

            self.smoother = LabelSmoother(epsilon=args.label_smoothing_factor)
        self._warned_no_labels = False

    def compute(
        self,
        model: nn.Module,
        batch: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss of ``batch`` through ``model``; see the module docstring. ``return_outputs``
        also returns the model's outputs (evaluation reads the logits)."""
        labels = None
        if loss_from_outputs(self.func, self.args.label_smoothing_factor):
            batch, labels = split_labels(batch)
        if num_items_in_batch is not None and accepts_loss_kwargs(model):
            batch = {**batch, "num_items_in_batch": num_items_in_batch}
        outputs = model(**batch)
        if self.func is not None:
            loss = self._call_func(outputs, labels, num_items_in_batch)
        elif labels is not None:
            loss = self.smoother(outputs, labels, shift_labels=is_causal_lm(model))
        else:
            loss = model_loss(outputs, f"{class_label(unwrap_model(model))}.forward")
        return (loss, outputs) if return_outputs else loss

    def _call_func(self, outputs: Any, labels: Any, num_items: Any) -> torch.Tensor:
        func = self.func
        if labels is None and not self._warned_no_labels:
            self._warned_no_labels = True
            self.warn(
                "compute_loss_func is called with labels=None: the batches have no 'labels' key",
                level=logging.WARNING,
            )
        if self.takes_items:
            loss = func(outputs, labels, num_items_in_batch=num_items)
        else:
            loss = func(outputs, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            name = getattr(func, "__name__", None) or getattr(
                getattr(func, "func", None), "__name__", "compute_loss_func"
            )
            got = type(loss).__name__
            if isinstance(loss, torch.Tensor):
                got = f"a tensor of shape {tuple(loss.shape)}"
            raise ValueError(
                f"trainer.compute_loss_func ({name}) must return the loss, a tensor with one "
                f"value (got {got}); reduce it, e.g. with reduction='mean'"
            )
        return loss.reshape(())

    def items_ranks(self, topology: Any) -> int:
        """The ranks whose label tokens ``num_items_in_batch`` counts."""
        return topology.dp_size if self.args.average_tokens_across_devices else 1

    def num_items_in_batch(
        self,
        window: list[Mapping[str, Any]],
        model: nn.Module,
        over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Hugging Face's ``num_items_in_batch`` for a ``compute_loss_func`` that takes it:
        the label tokens (not -100) of ``window``'s ``labels`` (``shift_labels`` where a batch
        has them; without each row's first label where the model's loss shifts them), summed
        over the ranks by ``over_ranks`` when given. None otherwise, or when the labels are no
        tensors."""
        if not self.takes_items or not window or "labels" not in window[0]:
            return None
        shifts = loss_shifts_labels(model)
        try:
            count = sum(
                (
                    batch["shift_labels"]
                    if "shift_labels" in batch
                    else batch["labels"][..., 1:]
                    if shifts
                    else batch["labels"]
                )
                .ne(IGNORE_INDEX)
                .sum()
                for batch in window
            )
        except (TypeError, AttributeError):
            return None
        return over_ranks(count) if over_ranks is not None else count


def returned_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned, if any: ``.loss``, ``["loss"]`` or, as Hugging Face reads a
    tuple, its first element when that is a 0-d tensor (training and evaluation read it alike)."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, (tuple, list)) and outputs:
        first = outputs[0]
        loss = first if isinstance(first, torch.Tensor) and first.dim() == 0 else None
    return loss


def model_loss(outputs: Any, label: str, batch_keys: str = "") -> torch.Tensor:
    """The loss a model returned (``returned_loss``); a ValueError that says what to do
    otherwise. ``label`` names the forward (``Net.forward``), ``batch_keys`` the keys of the
    batch it was given."""
    loss = returned_loss(outputs)
    if loss is not None:
        return loss
    if isinstance(outputs, torch.Tensor):
        raise ValueError(bare_tensor_message(outputs, label))
    given = f" for a batch with keys {batch_keys}" if batch_keys else ""
    raise ValueError(
        f"{label} returned no loss ({type(outputs).__name__} without 'loss'){given}: give the "
        "batches labels (e.g. data_collator: CausalLMCollator), give the trainer "
        "compute_loss_func(outputs, labels) to compute it, compute the loss in forward, or "
        "override Trainer.compute_loss"
    )


def loss_from_outputs(compute_loss_func: Any, label_smoothing_factor: float) -> bool:
    """Whether the trainer computes the loss from the model's outputs and the batch's labels
    (``compute_loss_func``, or label smoothing), so the model is called without the labels
    (Hugging Face's rule), rather than reading the loss the model returns."""
    return compute_loss_func is not None or bool(label_smoothing_factor)


def split_labels(batch: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``batch`` without its ``labels``, and the labels (None when it has none)."""
    inputs = dict(batch)
    return inputs, inputs.pop("labels", None)


def takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` can be called with the keyword ``name``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature (some builtins)
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for p in parameters
    )


def default_label_names(model: Any) -> list[str]:
    """The batch keys that hold labels: the ``forward`` parameters with "label" in their name
    (start/end positions for question answering), as HF's Trainer finds them. ``model`` is a
    module (looked at through its wrappers) or a module class. No names for a model that hands its
    step the batch whole (``takes_whole_batch``, as LightningAdapter), whose step reads its
    labels itself."""
    from transformers.utils import find_labels

    if getattr(model, "takes_whole_batch", False):
        return []

    return find_labels(
        model if isinstance(model, type) else type(unwrap_model(model, through_adapters=True))
    )


def resolve_label_names(given: Sequence[str] | None, model: Any, has_loss_func: bool) -> list[str]:
    """The trainer's label names: ``given`` (``args.label_names``), else ``model``'s
    (``default_label_names``; a module or a module class); with a ``compute_loss_func`` and
    none of those, ``labels`` (what the function gets)."""
    if given is not None:
        return list(given)
    names = default_label_names(model) if model is not None else ["labels"]
    if not names and has_loss_func:
        return ["labels"]
    return names


def is_causal_lm(model: nn.Module) -> bool:
    """A decoder-only generative model (its loss shifts the labels by one token)."""
    model = unwrap_model(model, through_adapters=True)
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    if config is None or not callable(can_generate):
        return False
    return bool(can_generate()) and not getattr(config, "is_encoder_decoder", False)


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss predicts label i+1 at position i (a causal LM's), so the first
    label of each row is no target: Hugging Face's Trainer asks the loss its ``loss_type``
    names, and leaves encoder-decoders out."""
    model = unwrap_model(model, through_adapters=True)
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # transformers before its loss mapping
        return is_causal_lm(model)
    config = getattr(model, "config", None)
    shifted = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return shifted and not getattr(config, "is_encoder_decoder", False)


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether ``forward`` takes loss keywords such as ``num_items_in_batch``: the model's
    ``accepts_loss_kwargs`` where it says, else whether ``forward`` takes ``**kwargs`` (as
    Hugging Face's Trainer decides)."""
    model = unwrap_model(model, through_adapters=True)
    said = getattr(model, "accepts_loss_kwargs", None)
    if said is not None:
        return bool(said)
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in parameters)


def batch_size_of(batch: Mapping[str, Any]) -> int:
    from transformers.trainer_pt_utils import find_batch_size

    size = find_batch_size(dict(batch))
    return int(size) if size is not None else 1
