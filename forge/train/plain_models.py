"""Models written for plain PyTorch rather than Hugging Face, and what to say when a batch or a
model's output does not fit the trainers' contract (a LightningModule has an adapter of its own:
forge/train/lightning/).

forge's trainers call ``model(**batch)`` and read the loss from ``.loss`` or ``["loss"]``
(Hugging Face's convention). A model whose ``forward`` returns its loss as a bare tensor, or
a tuple with the loss first, is wrapped in :class:`LossAdapter` instead of being rewritten;
tuple items from the dataset are named by ``forge.data.TupleCollator``; a model that returns
predictions only gets its loss from the trainer's ``compute_loss_func`` (forge/train/loss.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from forge.data.collator import tuple_collator_hint

__all__ = ["LossAdapter", "as_model_output", "bare_tensor_message", "not_a_dict_batch"]

LOSS_FUNC_EXAMPLE = "compute_loss_func: !partial:torch.nn.functional:cross_entropy []"


class LossAdapter(nn.Module):
    """``module``'s forward, its result returned as ``{"loss": ..., "logits": ...}``.

    What ``module`` returns becomes:

    - a 0-d tensor (the loss): ``{"loss": tensor}``
    - any other tensor (predictions, e.g. when called without a target): ``{"logits": tensor}``
    - a tuple or list whose first element is a 0-d tensor: ``{"loss": first, "logits": rest}``
      (the rest alone when it is one element), as Hugging Face reads tuple outputs
    - a dict or a Hugging Face output: unchanged

    ``module`` is an ``nn.Module`` or a zero-argument callable that builds one (a ``!partial``,
    called when the trainer builds the model, after seeding). It is kept as ``self.module``,
    where forge looks through wrappers as it does through DDP: checkpoints hold ``module``'s
    own ``state_dict`` (its keys, no prefix), so the weights load into the plain model, and the
    batch keys are checked against ``module``'s forward. In a config::

        model: &model !partial:forge.train:LossAdapter
            module: !partial:./model.py:Net {hidden_size: 64}
    """

    def __init__(self, module: nn.Module | Callable[[], nn.Module]) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            if not callable(module):
                raise TypeError(
                    "LossAdapter module must be an nn.Module or a callable that builds one "
                    f"(got {type(module).__name__})"
                )
            module = module()
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"LossAdapter module built a {type(module).__name__}, not an nn.Module"
                )
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return as_model_output(self.module(*args, **kwargs))


def as_model_output(outputs: Any) -> Any:
    """A bare tensor or a tuple, as the dict ``LossAdapter`` returns; anything else unchanged."""
    if isinstance(outputs, torch.Tensor):
        return {"loss": outputs} if outputs.dim() == 0 else {"logits": outputs}
    if isinstance(outputs, Mapping) or not isinstance(outputs, (tuple, list)) or not outputs:
        return outputs
    first, rest = outputs[0], tuple(outputs[1:])
    if not (isinstance(first, torch.Tensor) and first.dim() == 0):
        return {"logits": tuple(outputs)}
    if not rest:
        return {"loss": first}
    return {"loss": first, "logits": rest[0] if len(rest) == 1 else rest}


def bare_tensor_message(tensor: torch.Tensor, label: str) -> str:
    """What to do about a forward that returns a bare tensor: its loss, or its predictions."""
    head = f"{label} must return an object with .loss or a dict with 'loss' (got Tensor)"
    if tensor.dim() == 0:
        return (
            f"{head}; to train a forward that returns its loss as a tensor, wrap the model "
            "(its weights keep their names): model: !partial:forge.train:LossAdapter "
            "{module: !partial:...} with the model's own !partial as module, or return "
            "{'loss': loss} from forward"
        )
    return (
        f"{head}; a tensor of shape {tuple(tensor.shape)} is predictions, not a loss: give "
        "the trainer a compute_loss_func(outputs, labels) that computes the loss from them "
        f"(e.g. {LOSS_FUNC_EXAMPLE}), or return {{'loss': loss, 'logits': logits}} from "
        "forward"
    )


def forward_names(model: Any) -> list[str]:
    """The named parameters of the forward a batch is given to (through wrappers such as
    DDP and LossAdapter); ``model`` is a module or a module class."""
    from forge.wrappers import unwrap_model

    if isinstance(model, nn.Module):
        model = unwrap_model(model, through_adapters=True)
    forward = getattr(model, "forward", None)
    if forward is None:
        return []
    parameters = list(inspect.signature(forward).parameters.values())
    if isinstance(model, type):
        parameters = parameters[1:]  # self
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in kinds]


def not_a_dict_batch(batch: Any, model: Any) -> str:
    """Why a batch that is no dict cannot be given to ``model(**batch)``, and the fix: for a
    tuple (a dataset yielding ``(inputs, target)``), the TupleCollator that names its parts."""
    kind = type(batch).__name__
    if isinstance(batch, (tuple, list)):
        hint = tuple_collator_hint(len(batch), forward_names(model) if model is not None else [])
        return (
            f"batches must be dicts of tensors, as the trainer calls model(**batch), but this "
            f"one is a {kind} of {len(batch)} (the dataset's items are tuples, or the collator "
            f"returns one); name the parts with {hint} (the names of forward's arguments), or "
            "make the items dicts"
        )
    return (
        f"batches must be dicts of tensors (got {kind}); make the dataset yield dicts or pass "
        "a data_collator that builds them"
    )
