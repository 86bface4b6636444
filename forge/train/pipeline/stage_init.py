"""Build part of a model: a pipeline stage's own modules, with the weights the whole model gets.

A stage must not hold the whole model, yet its weights must be exactly those the unsplit
model gets from the same seed (so a pipeline run trains like a single process). For Hugging
Face models both hold: the model is built on the meta device while every random draw of its
construction and initialisation is replayed on a scratch CPU tensor of the same shape, so the
global generator moves exactly as it would for the real model; the random state before each
module's ``_init_weights`` is recorded. Then only the kept modules are materialised, and each
one's ``_init_weights`` runs again from its recorded state. Memory stays at the stage's weights
plus one scratch tensor at a time. Nothing of transformers or torch is patched: the recording
uses torch's module-registration hook and wrappers on the model's own instances, all removed
however the build ends.

Other modules initialise their weights inside their constructors, where no such record is
possible; they are built whole on the CPU and pruned afterwards, as is a Hugging Face model
whose ``_init_weights`` leaves a kept weight unset (materialised tensors start as NaN, so one
left unwritten is seen), or one that cannot be built on the meta device; a warning says which.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from forge.wrappers import class_label

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


class _InitEachHFModel(contextlib.AbstractContextManager):
    """Initialise each Hugging Face model of a meta-device build when its constructor is done,
    recording the random state before each module's ``_init_weights``; patches nothing.

    On the meta device transformers skips weight initialisation (``init_weights``), so it runs
    here instead, at the moment the real build would have run it: a model built inside another
    (``LlamaModel`` inside ``LlamaForCausalLM``) when it is assigned to its parent (torch's
    module-registration hook, removed on exit), the outermost one by ``finish``. The record
    comes from per-instance wrappers of ``_initialize_weights``, removed after each model's
    initialisation, so neither transformers nor torch is changed for anyone else.
    """

    def __init__(self, records: list[InitRecord]) -> None:
        from transformers import PreTrainedModel

        self.records = records
        self._pretrained = PreTrainedModel
        self._handle: Any = None
        self._done: set[int] = set()  # the models initialised here, and their modules
        self.library_initialised: list[str] = []  # models the library initialised on meta

    def __enter__(self) -> _InitEachHFModel:
        self._handle = torch.nn.modules.module.register_module_module_registration_hook(
            self._on_registration
        )
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._handle.remove()

    def _on_registration(self, parent: nn.Module, name: str, module: Any) -> None:
        if isinstance(module, self._pretrained):
            self.finish(module)

    def finish(self, model: nn.Module) -> None:
        """Initialise ``model`` (its modules not initialised yet), recording each module's
        random state."""
        if id(model) in self._done:
            return
        flagged = [m for m in model.modules() if getattr(m, "_is_hf_initialized", False)]
        if any(id(m) not in self._done for m in flagged):
            # a transformers that initialises on the meta device itself: nothing to record
            self.library_initialised.append(type(model).__name__)
        owners = [m for m in model.modules() if isinstance(m, self._pretrained)]
        for owner in owners:
            owner._initialize_weights = self._recording(owner)  # this instance only
        try:
            model.initialize_weights()
        finally:
            for owner in owners:
                del owner._initialize_weights
        self._done.update(id(m) for m in model.modules())

    def _recording(self, owner: nn.Module) -> Callable[..., Any]:
        original = owner._initialize_weights  # the class's, bound to this instance

        def recording(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not getattr(module, "_is_hf_initialized", False):
                self.records.append((module, owner, torch.get_rng_state()))
            return original(module, *args, **kwargs)

        return recording


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

    # the recording relies on transformers' per-module initialisation (_initialize_weights)
    return issubclass(target, PreTrainedModel) and all(
        hasattr(PreTrainedModel, name) for name in ("_initialize_weights", "initialize_weights")
    )


def keeps(name: str, kept: Collection[str]) -> bool:
    """Whether module ``name`` is one of ``kept`` or inside one."""
    return any(name == k or name.startswith(k + ".") for k in kept)


def build_partial_model(model_init: Callable[[], nn.Module], kept: Collection[str]) -> nn.Module:
    """The model ``model_init`` builds, with real tensors only in the modules named in ``kept``
    (and their children); every other tensor stays on the meta device, to be pruned.

    The kept weights equal those of ``model_init()`` called with the same random state, and the
    global generator ends where that call would leave it. Where the stage cannot be built
    alone, the whole model is built and pruned (a warning says why, once per process).
    """
    if not _builds_hf_model(model_init):
        logger.info("the model is not a Hugging Face one: building it whole, then pruning")
        return _build_whole(model_init, kept)  # initialised in its constructors
    start = torch.get_rng_state()
    records: list[InitRecord] = []
    try:
        with torch.device("meta"), _ReplayRandomOnCPU(), _InitEachHFModel(records) as init:
            model = model_init()
            if _is_hf_model(model):
                init.finish(model)
    except Exception as exc:  # noqa: BLE001 - any failure: the whole build says what is wrong
        return _fall_back(model_init, kept, start, f"building it on the meta device failed ({exc})")
    if not _is_hf_model(model):  # a builder that wraps a Hugging Face model in its own module
        reason = f"its builder returned a {class_label(model)}, not a transformers model"
        return _fall_back(model_init, kept, start, reason)
    if init.library_initialised:
        reason = (
            f"this transformers initialises {init.library_initialised[0]} on the meta device "
            "itself, which leaves no record of each module's random state"
        )
        return _fall_back(model_init, kept, start, reason)
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
        reason = f"{class_label(model)} initialises {unset[0]} in its constructor"
        return _fall_back(model_init, kept, start, reason)
    torch.set_rng_state(end)
    return model


_warned_whole: set[str] = set()


def warn_whole_build(what: str, reason: str) -> None:
    """Say once per process (at warning level) that a rank builds the whole model: every
    rank then holds all its weights for a while, which a stage-only build avoids."""
    if what in _warned_whole:
        return
    _warned_whole.add(what)
    logger.warning("%s: %s; each rank holds the whole model while it is built", what, reason)


def _fall_back(
    model_init: Callable[[], nn.Module], kept: Collection[str], start: torch.Tensor, reason: str
) -> nn.Module:
    warn_whole_build("building the whole model for this pipeline stage, then pruning it", reason)
    torch.set_rng_state(start)
    return _build_whole(model_init, kept)


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
