"""The user's model inside the wrappers that training puts around it.

One function for every place that needs "the model itself": the checkpoint layer (whose weights
to save and load, which class to describe) and the trainers (whose ``forward`` names the
inputs, whose config says how the loss shifts labels).

Peeled always: ``DistributedDataParallel`` / ``DataParallel`` / FSDP(1) / DeepSpeed's engine
and forge's ``LossAdapter`` and ``LightningAdapter`` (all keep the model as ``.module``), and ``torch.compile``
(``._orig_mod``); Accelerate's ``prepare`` uses exactly these. Any other module that keeps a
child as ``.module`` (a user's own wrapper) is peeled only when it holds no parameter or buffer
of its own: one that does is the model, and its state (the child's under ``module.``) is saved
whole.

A peft ``PeftModel`` is *kept* by default: with adapters the PEFT model is the model being
trained. Its state-dict names (``base_model.model....lora_A.default.weight``) are what a
checkpoint holds and a resume loads, and its own ``save_pretrained`` writes the adapter; peeling
it would save the base model with the adapter layers injected under names no one loads.
``through_adapters=True`` goes on to the PEFT model's base transformers model, for what only
the base model knows: its ``forward``'s parameter names, its config, its label names, its
FLOP estimate.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["class_label", "is_peft_model", "unwrap_model"]


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (or a mixed-adapter model) around a base."""
    if "peft" not in sys.modules:  # peft never imported: no model can be one of its classes
        return False
    peft = sys.modules["peft"]
    kinds = tuple(
        kind
        for kind in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None))
        if isinstance(kind, type)
    )
    return bool(kinds) and isinstance(model, kinds)


def unwrap_model(model: nn.Module, *, through_adapters: bool = False) -> nn.Module:
    """The model inside DDP / DataParallel / FSDP / Accelerate / torch.compile / LossAdapter.

    A PEFT model is returned as it is (it is the trained model: its names are the
    checkpoint's), or, with ``through_adapters``, unwrapped to its base transformers model.
    """
    from torch import nn

    while True:
        if is_peft_model(model):
            if not through_adapters:
                return model
            model = model.get_base_model()
            continue
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
            if isinstance(inner, nn.Module) and _holds_state_beside(model, inner):
                return model  # a wrapper with weights of its own is the model
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def class_label(obj: object, *, qualified: bool = False) -> str:
    """How forge names the class of ``obj`` (or the class ``obj``) to the user:
    ``seqmodel.py:GRUClassifier`` for a class of a project file (a ``./seqmodel.py`` spec loads
    it under an internal module name, which means nothing to the user), else the class's name
    (``qualified``: with its module, ``transformers.models....LlamaForCausalLM``). FSDP2's
    ``FSDP<Name>`` subclass is named as the class it shards."""
    cls = obj if isinstance(obj, type) else type(obj)
    if any(base.__name__ == "FSDPModule" for base in cls.__bases__):
        cls = next(base for base in cls.__bases__ if base.__name__ != "FSDPModule")
    file = getattr(sys.modules.get(cls.__module__), "__forge_file__", None)
    if file:
        return f"{file}:{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}" if qualified else cls.__qualname__


#: wrappers that keep the model as ``.module`` and whose own state, if any, is the model's
_WRAPPERS = {
    "DistributedDataParallel",
    "DataParallel",
    "FullyShardedDataParallel",
    "DeepSpeedEngine",
    "LossAdapter",
    "LightningAdapter",
}


def _holds_state_beside(outer: nn.Module, inner: nn.Module) -> bool:
    """Whether ``outer`` (not one of the known wrappers) has a parameter or buffer that is not
    ``inner``'s."""
    if type(outer).__name__ in _WRAPPERS:
        return False
    inside = {id(t) for t in (*inner.parameters(), *inner.buffers())}
    return any(id(t) not in inside for t in (*outer.parameters(), *outer.buffers()))
