"""Build part of a model: a pipeline stage's own modules, with the weights the whole model gets.

A stage must not hold the whole model, yet its weights must be exactly those the unsplit
model gets from the same seed (so a pipeline run trains like a single process). For Hugging
Face models both hold: the model is built on the meta device while every random draw of its
construction and initialisation is replayed on a scratch CPU tensor of the same shape, so the
global generator moves exactly as it would for the real model; the random state before each
module's ``_init_weights`` is recorded. Then only the kept modules are materialised, and each
one's ``_init_weights`` runs again from its recorded state. Memory stays at the stage's weights
plus one scratch tensor at a time.

Other modules initialise their weights inside their constructors, where no such record is
possible; they are built whole on the CPU and pruned afterwards, as is a Hugging Face model
whose ``_init_weights`` leaves a kept weight unset (materialised tensors start as NaN, so one
left unwritten is seen).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

logger = logging.getLogger(__name__)


class _ReplayRandomOnCPU(TorchDispatchMode):
    """Random ops on meta tensors also run on a CPU scratch tensor, advancing the generator
    exactly as the same op on a real tensor would (the draws depend on shape and dtype only)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _on_meta(args, kwargs):

            def scratch(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.is_meta:
                    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
                return value

            real_kwargs = {
                k: torch.device("cpu") if k == "device" else v for k, v in kwargs.items()
            }
            func(*tree_map(scratch, args), **tree_map(scratch, real_kwargs))
        return func(*args, **kwargs)


def _on_meta(args: Any, kwargs: dict[str, Any]) -> bool:
    if str(kwargs.get("device")) == "meta":
        return True
    flat, _ = tree_flatten((args, kwargs))
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in flat)


InitRecord = tuple[nn.Module, nn.Module, torch.Tensor]  # module, its PreTrainedModel, rng state


@contextlib.contextmanager
def _recording_hf_inits(records: list[InitRecord]) -> Iterator[None]:
    """Run Hugging Face's weight initialisation even on the meta device, recording the random
    state before each module's ``_init_weights``."""
    import transformers.modeling_utils as hf

    original_init = hf.PreTrainedModel._initialize_weights
    original_device = getattr(hf, "get_torch_context_manager_or_global_device", None)

    def recording(self, module, *args, **kwargs):
        if not getattr(module, "_is_hf_initialized", False):
            records.append((module, self, torch.get_rng_state()))
        return original_init(self, module, *args, **kwargs)

    hf.PreTrainedModel._initialize_weights = recording
    if original_device is not None:  # transformers 5 skips initialisation on meta
        hf.get_torch_context_manager_or_global_device = lambda: None
    try:
        yield
    finally:
        hf.PreTrainedModel._initialize_weights = original_init
        if original_device is not None:
            hf.get_torch_context_manager_or_global_device = original_device


def _is_hf_model(model: nn.Module) -> bool:
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _builds_hf_model(model_init: Callable[[], nn.Module]) -> bool:
    """Whether ``model_init`` is (a partial of) a Hugging Face model class."""
    target = getattr(model_init, "func", model_init)
    if not isinstance(target, type) or "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    # the recording relies on the per-module initialisation hook of transformers 4.x / 5.x
    return issubclass(target, PreTrainedModel) and hasattr(PreTrainedModel, "_initialize_weights")


def keeps(name: str, kept: Collection[str]) -> bool:
    """Whether module ``name`` is one of ``kept`` or inside one."""
    return any(name == k or name.startswith(k + ".") for k in kept)


def build_partial_model(model_init: Callable[[], nn.Module], kept: Collection[str]) -> nn.Module:
    """The model ``model_init`` builds, with real tensors only in the modules named in ``kept``
    (and their children); every other tensor stays on the meta device, to be pruned.

    The kept weights equal those of ``model_init()`` called with the same random state, and the
    global generator ends where that call would leave it.
    """
    if not _builds_hf_model(model_init):
        return _build_whole(model_init, kept)  # initialised in its constructors
    start = torch.get_rng_state()
    records: list[InitRecord] = []
    with _recording_hf_inits(records), torch.device("meta"), _ReplayRandomOnCPU():
        model = model_init()
    if not _is_hf_model(model):  # a builder that wraps a Hugging Face model in its own module
        torch.set_rng_state(start)
        return _build_whole(model_init, kept)
    end = torch.get_rng_state()
    ties = tie_groups(model)
    kept = with_tie_owners(kept, ties)
    _materialise(model, kept, ties)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for module, owner, state in records:
        if keeps(names.get(id(module), ""), kept):
            torch.set_rng_state(state)
            owner._init_weights(module)
    _retie(ties)
    unset = _unset_tensors(model)
    if unset:  # a weight its _init_weights leaves to the constructor: build the model whole
        logger.info(
            "%s initialises %s in its constructor; building the whole model for this stage",
            type(model).__name__,
            unset[0],
        )
        torch.set_rng_state(start)
        return _build_whole(model_init, kept)
    torch.set_rng_state(end)
    return model


def _build_whole(model_init: Callable[[], nn.Module], kept: Collection[str]) -> nn.Module:
    model = model_init()
    free_except(model, kept)
    return model


Holder = tuple[str, nn.Module, str, bool]  # module name, module, attribute, is a parameter


def tie_groups(model: nn.Module) -> list[list[Holder]]:
    """Every parameter and buffer with the modules that hold it, the first holder first."""
    groups: dict[int, list[Holder]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                groups.setdefault(id(param), []).append((module_name, module, attr, True))
        for attr, buffer in module._buffers.items():
            if buffer is not None:
                groups.setdefault(id(buffer), []).append((module_name, module, attr, False))
    return list(groups.values())


def with_tie_owners(kept: Collection[str], ties: list[list[Holder]]) -> set[str]:
    """``kept`` plus the first holder of every tensor a kept module shares with another module
    (an input embedding tied to a kept output head), so the tie keeps its canonical name."""
    owners = {
        group[0][0]
        for group in ties
        if len(group) > 1 and any(keeps(name, kept) for name, *_ in group)
    }
    return set(kept) | owners


def _materialise(model: nn.Module, kept: Collection[str], ties: list[list[Holder]]) -> None:
    """Give each holder in a kept module its own CPU tensor, NaN until initialised (ties undone,
    so each module's initialisation writes its own tensor, as in the unsplit model before
    tying)."""
    for group in ties:
        for module_name, module, attr, is_param in group:
            if not keeps(module_name, kept):
                continue
            table = module._parameters if is_param else module._buffers
            old = table[attr]
            new = torch.empty_like(old, device="cpu")
            if new.is_floating_point():
                new.fill_(float("nan"))
            table[attr] = nn.Parameter(new, requires_grad=old.requires_grad) if is_param else new


def _unset_tensors(model: nn.Module) -> list[str]:
    """Names of materialised tensors that initialisation left (partly) unwritten."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [
        name
        for name, t in tensors
        if not t.is_meta and t.is_floating_point() and bool(torch.isnan(t).any())
    ]


def _retie(ties: list[list[Holder]]) -> None:
    """Every holder of a tied tensor gets its first holder's (as ``tie_weights`` leaves it)."""
    for group in ties:
        if len(group) < 2:
            continue
        _, first, first_attr, is_param = group[0]
        table = first._parameters if is_param else first._buffers
        for _, module, attr, _ in group[1:]:
            (module._parameters if is_param else module._buffers)[attr] = table[first_attr]


def free_except(model: nn.Module, kept: Collection[str]) -> None:
    """Replace the tensors of every module outside ``kept`` with meta ones (to be pruned);
    a tensor a kept module shares stays real."""
    for group in tie_groups(model):
        if any(keeps(name, kept) for name, *_ in group):
            continue
        for _, module, attr, is_param in group:
            table = module._parameters if is_param else module._buffers
            old = table[attr]
            meta = torch.empty_like(old, device="meta")
            table[attr] = nn.Parameter(meta, requires_grad=old.requires_grad) if is_param else meta
