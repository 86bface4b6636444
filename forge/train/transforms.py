"""The model-transform stage: everything that happens to a model between "built" and
"trained", one small function per step. ``BaseTrainer.transform_model`` applies them in this
order (the last step, ``parallelize``, is the trainer's strategy):

    build (model_init after seeding; a pipeline stage builds only its part)
    -> the model's settings (``use_cache``, its loss type)
    -> adapters (peft LoRA with a trainer's ``peft_config``: forge/train/lora.py)
    -> placement on the device
    -> activation checkpointing
    -> ``torch.compile``
    -> the strategy's parallel wrap (DDP, FSDP2, Accelerate's ``prepare``, the pipeline's stages)

No step patches a library: activation checkpointing replaces the ``forward`` of the block
instances it wraps, so parameter and state-dict names (checkpoints, optimizer state keyed by
name, ``from_pretrained``) do not change.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from forge.suggest import suggestion
from forge.text import short_list
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.lora import LoraStep
from forge.train.runtime import name_causal_lm_loss
from forge.wrappers import class_label

logger = logging.getLogger(__name__)

#: containers whose children are a model's repeated blocks
_BLOCK_LISTS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
#: ``activation_checkpointing_kwargs`` keys that are Hugging Face's, not torch's checkpoint's
_HF_ONLY = ("offload",)
#: keywords ``torch.utils.checkpoint.checkpoint`` documents but takes through its ``**kwargs``
_THROUGH_KWARGS = {"preserve_rng_state"}


def apply_model_settings(model: nn.Module, args: TrainingArguments) -> None:
    """For a model with a config, ``use_cache`` (as HF's Trainer sets it) and its loss type."""
    name_causal_lm_loss(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = args.use_cache


# ---------------------------------------------------------------------- activation checkpointing
def adapter_step(peft_config: Any) -> LoraStep | None:
    """The adapter step for a trainer's ``peft_config`` (None: no adapter)."""
    return None if peft_config is None else LoraStep(peft_config)


def apply_activation_checkpointing(
    model: nn.Module,
    args: TrainingArguments,
    *,
    layers: str | None = None,
    names_checked: bool = False,
) -> str | None:
    """Checkpoint the model's blocks as ``args`` ask; a line saying what was wrapped (None when
    activation checkpointing is off).

    With ``activation_checkpointing_modules`` the named blocks are wrapped (see
    ``checkpointed_blocks``); without, a model with Hugging Face's
    ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` gets that method
    (non-reentrant unless ``activation_checkpointing_kwargs`` say otherwise, as HF's Trainer),
    and any other model its repeated layers. ``layers`` names the repeated layers where the
    caller knows them (the pipeline trainer: the stage's layers, always wrapped by forge).
    ``names_checked``: the names were checked against the whole model already (a pipeline
    stage holds only some of them), so a name this model lacks is skipped.
    """
    if not args.activation_checkpointing:
        return None
    every = args.activation_checkpointing_every
    names = args.activation_checkpointing_modules
    if names is None and layers is None:
        described = _hf_checkpointing(model, args, every)
        if described is not None:
            return described
    if names is None:
        names = (layers,) if layers is not None else None
    blocks = checkpointed_blocks(model, args, names, strict=not names_checked)
    checkpoint = _checkpoint_function(args)
    chosen = [
        name for position, (name, _) in enumerate(blocks) if _index(name, position) % every == 0
    ]
    for name, block in blocks:
        if name in chosen:
            checkpoint_forward(block, checkpoint)
    return f"activation checkpointing: {len(chosen)} of {len(blocks)} blocks ({_span(chosen)})"


def checkpointed_blocks(
    model: nn.Module,
    args: TrainingArguments,
    names: tuple[str, ...] | list[str] | None,
    *,
    strict: bool = True,
) -> list[tuple[str, nn.Module]]:
    """The blocks ``names`` select, in model order, none inside another.

    A name is a module path (``model.layers.3``; a list of blocks such as ``model.layers``
    selects each of its children) or a class name (``LlamaDecoderLayer``: every module of that
    class). None: the model's repeated layers, every stack of them (``repeated_layers``).
    A name that selects nothing raises TrainingArgumentsError (``strict``) or is skipped.
    """
    modules = dict(model.named_modules())
    if names is None:
        names = _repeated_layers(modules)
        if not names:
            raise TrainingArgumentsError([_no_layers_message(model, args)])
    problems = [
        message
        for name in names
        if (message := selection_problem(modules, name, class_label(model), args)) and strict
    ]
    if problems:
        raise TrainingArgumentsError(problems)
    selected: dict[str, nn.Module] = {}
    for name in names:
        module = modules.get(name)
        if isinstance(module, _BLOCK_LISTS):
            selected.update((f"{name}.{child}", m) for child, m in module.named_children())
        elif module is not None and name:
            selected[name] = module
        else:
            selected.update((n, m) for n, m in modules.items() if n and type(m).__name__ == name)
    ordered = [name for name in modules if name in selected]
    return [
        (name, selected[name])
        for name in ordered
        if not any(name.startswith(outer + ".") for outer in ordered)
    ]


def selection_problem(
    modules: dict[str, nn.Module],
    name: str,
    model_name: str,
    args: TrainingArguments,
    key: str = "activation_checkpointing_modules",
) -> str | None:
    """Why ``name`` (of the argument ``key``) selects nothing in a model with ``modules``;
    None when it selects some."""
    if name and (name in modules or any(type(m).__name__ == name for m in modules.values())):
        return None
    paths = [n for n in modules if n]
    classes = sorted({type(m).__name__ for m in modules.values()})
    examples = dict.fromkeys([*_repeated_layers(modules), *paths[:2]])
    return (
        f"{args.config_key}.{key}: {model_name} has no module or "
        f"module class {name!r}{suggestion(name, paths + classes)} Name module paths "
        f"(e.g. {short_list(repr(p) for p in examples if p)}) or classes "
        f"({short_list(classes, 8)})"
    )


def repeated_layers(model: nn.Module) -> list[str]:
    """The names of the model's repeated layers, every stack of them in model order: each
    module list (``ModuleList``, ``ModuleDict`` or ``Sequential``) of blocks of one class that
    hold parameters, not inside another such list. T5's ``encoder.block`` and
    ``decoder.block``, a Llama's ``model.layers``, a ViT's ``encoder.layer``. Lists of plain
    layers (``Linear``, ``LayerNorm``: modules without children, such as a per-layer list of
    norms beside the blocks) count only when the model has no list of blocks. Empty: none."""
    return _repeated_layers(dict(model.named_modules()))


def _repeated_layers(modules: dict[str, nn.Module]) -> list[str]:
    lists = {}
    for name, module in modules.items():
        children = list(module.children())
        if not isinstance(module, _BLOCK_LISTS) or not children:
            continue
        if len({type(child) for child in children}) == 1 and _holds_parameters(module):
            lists[name] = any(True for _ in children[0].children())
    blocks = [name for name, composite in lists.items() if composite]
    stacks = blocks or list(lists)
    return [name for name in stacks if not any(_inside(name, outer) for outer in stacks)]


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _inside(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` (the root: "")."""
    return name != outer and (not outer or name.startswith(outer + "."))


def _no_layers_message(model: nn.Module, args: TrainingArguments) -> str:
    kind = class_label(model)
    return (
        f"{args.config_key}.activation_checkpointing wraps a model's repeated layers (a "
        f"ModuleList of blocks of one class) and uses a Hugging Face model's "
        f"gradient_checkpointing_enable(); {kind} has none. Name the blocks to wrap in "
        f"{args.config_key}.activation_checkpointing_modules (module paths or class names of "
        f"{kind}: {short_list(sorted({type(m).__name__ for m in model.modules()}), 8)}), or set "
        "activation_checkpointing to false"
    )


def _index(name: str, position: int) -> int:
    """A block's number for ``activation_checkpointing_every``: its layer number (the last
    part of its name: ``model.layers.6`` is 6, also in a pipeline stage), else its position."""
    last = name.rpartition(".")[2]
    return int(last) if last.isdigit() else position


def _span(names: list[str]) -> str:
    if len(names) <= 3:
        return ", ".join(names) or "none"
    return f"{names[0]}, {names[1]}, ..., {names[-1]}"


def _checkpoint_function(args: TrainingArguments) -> Callable[..., Any]:
    """``torch.utils.checkpoint.checkpoint``, non-reentrant, with the random state kept (so
    dropout recomputes the same mask) and ``activation_checkpointing_kwargs``."""
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    offload = bool(kwargs.pop("offload", False))
    if kwargs.get("use_reentrant", False):
        raise TrainingArgumentsError(
            [
                f"{args.config_key}.activation_checkpointing_kwargs use_reentrant: true is for "
                "Hugging Face's gradient_checkpointing_enable(); forge checkpoints the blocks it "
                "wraps non-reentrantly (keyword arguments, any inputs). Remove use_reentrant"
            ]
        )
    kwargs["use_reentrant"] = False
    accepted = set(inspect.signature(torch.utils.checkpoint.checkpoint).parameters)
    accepted |= _THROUGH_KWARGS
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TrainingArgumentsError(
            [
                f"{args.config_key}.activation_checkpointing_kwargs has {unknown}, which "
                "torch.utils.checkpoint.checkpoint does not take; it takes "
                f"{sorted(accepted - {'function', 'args', 'kwargs'})} (and offload)"
            ]
        )
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)
    if not offload:
        return checkpoint

    def offloaded(function: Callable[..., Any], *inputs: Any, **keywords: Any) -> Any:
        pin = torch.cuda.is_available()
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return checkpoint(function, *inputs, **keywords)

    return offloaded


class _CheckpointedForward:
    """A block's forward run under activation checkpointing: its activations are recomputed in
    the backward pass instead of kept. Set as the block instance's ``forward``: the module
    tree, its names and its hooks stay as they were, and so does the forward's signature (what
    the block takes is read from it, e.g. by the pipeline's stages)."""

    def __init__(self, forward: Callable[..., Any], checkpoint: Callable[..., Any]) -> None:
        functools.update_wrapper(self, forward)
        self.forward = forward
        self.checkpoint = checkpoint

    def __call__(self, *inputs: Any, **keywords: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return self.forward(*inputs, **keywords)
        return self.checkpoint(self.forward, *inputs, **keywords)


def checkpoint_forward(block: nn.Module, checkpoint: Callable[..., Any]) -> None:
    """Run ``block``'s forward under ``checkpoint`` (once: a block wrapped already keeps its
    wrapper, so training again does not nest them)."""
    current = block.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        current.checkpoint = checkpoint
        return
    block.forward = _CheckpointedForward(block.forward, checkpoint)


def _hf_checkpointing(model: nn.Module, args: TrainingArguments, every: int) -> str | None:
    """Hugging Face's own switch, called as HF's Trainer calls it; None when the model has none,
    or when its version cannot checkpoint every ``every``-th layer or offload (forge's own
    wrapping does it then)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if not callable(enable):
        enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable) or not getattr(model, "supports_gradient_checkpointing", True):
        return None  # a model class that says it cannot: its blocks are wrapped by forge
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    options = {name: kwargs.pop(name) for name in _HF_ONLY if name in kwargs}
    if every > 1:
        options["every_n_layers"] = every
    takes = inspect.signature(enable).parameters
    if any(name not in takes for name in options):
        return None
    keyword = next((name for name in takes if name.endswith("checkpointing_kwargs")), None)
    if keyword is not None:
        options[keyword] = kwargs or {"use_reentrant": False}
    enable(**options)
    return f"activation checkpointing: {class_label(model)}.{enable.__name__}()"


def activation_checkpointing_problems(model: nn.Module, args: TrainingArguments) -> list[str]:
    """The named blocks ``model`` lacks (checked where the model's structure is known before
    training: a given module, a pipeline's meta-device skeleton)."""
    names = args.activation_checkpointing_modules
    if not args.activation_checkpointing or names is None:
        return []
    modules = dict(model.named_modules())
    found = (selection_problem(modules, name, class_label(model), args) for name in names)
    return [message for message in found if message]
