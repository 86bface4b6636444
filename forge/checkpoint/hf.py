"""Hugging Face model directories: the weight names a transformers architecture expects, and
the transformers model a module is or holds.

``from_pretrained`` builds the class that ``config.json`` names and loads weights by name: a
name the class does not have is dropped and a weight it has but does not find stays random, so
a directory whose names are not the class's own loads as an untrained model. forge therefore
writes ``config.json`` only beside weights named (and shaped) as the class built from that
config on the meta device names them, and ``forge export`` checks the same before it writes.

A module that is not a transformers model (a user's wrapper, even one with a ``config``
attribute) is written under its own names without ``config.json``; when it holds one
transformers model, the checkpoint's manifest records where and with which config
(:func:`describe_model`), so ``forge export`` can write that model as a directory of its own.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.wrappers import class_label

if TYPE_CHECKING:
    from torch import nn


CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
MODEL_RECORD = "model"  # the manifest key describing the checkpoint's model

Shapes = Mapping[str, tuple[int, ...]]


class ArchitectureError(ValueError):
    """A config's architecture cannot hold these weights, or cannot be built from it."""


class Unverifiable(ArchitectureError):
    """The names cannot be checked here: custom model code (never loaded by forge), a class
    this transformers does not have, or quantized weights (their layout is the quantizer's)."""


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``."""
    # transformers never imported: the model cannot be one of its classes
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def hf_model_in(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``("", model)`` for a transformers model; ``(name, submodule)`` for a module that holds
    exactly one outermost transformers model (``("lm", wrapper.lm)``); otherwise None."""
    if is_hf_model(model):
        return "", model
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and is_hf_model(module) and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return found[0] if len(found) == 1 else None


def architecture_name(model: nn.Module) -> str:
    """The class name ``save_pretrained`` records (FSDP2's ``FSDP`` prefix removed)."""
    return type(model).__name__.removeprefix("FSDP")


def prepare_config(model: nn.Module) -> Any:
    """The model's config as ``save_pretrained`` writes it: its architecture and dtype set."""
    config = model.config
    config.architectures = [architecture_name(model)]
    dtype = getattr(model, "dtype", None)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    return config


def describe_model(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint's manifest records of its model: its class and, for a module that
    holds one transformers model, that model's name in it and its config."""
    record: dict[str, Any] = {"class": class_label(model, qualified=True)}
    found = hf_model_in(model)
    if found is not None and found[0]:
        name, part = found
        record["hf_submodule"] = name
        record["hf_config"] = prepare_config(part).to_dict()
    return record


# ---------------------------------------------------------------------------------------------
# the names an architecture expects


@dataclass
class ExpectedWeights:
    """The state-dict names (and shapes) of one transformers class built from a config."""

    architecture: str
    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, set[str]]  # a name -> every name of the same tensor (tied weights)
    optional: list[str] = field(default_factory=list)  # patterns from_pretrained may miss
    ignored: list[str] = field(default_factory=list)  # patterns from_pretrained drops
    saved_shapes: dict[str, tuple[int, ...]] | None = None  # as save_pretrained renames them

    def mismatch(self, found: Shapes) -> str | None:
        """Why ``found`` (name -> shape) is not this class's weights, or None when it is.

        Tied names need only one of their names; names the class marks as optional or
        ignorable on load do not count. Names in ``save_pretrained``'s on-disk form (fused
        experts written one by one) are accepted as well.
        """
        problem = self._mismatch(found, self.shapes)
        if problem is not None and self.saved_shapes is not None:
            if self._mismatch(found, self.saved_shapes) is None:
                return None
        return problem

    def _mismatch(self, found: Shapes, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        missing = [
            name
            for name in shapes
            if name not in found
            and not any(other in found for other in self.aliases.get(name, ()))
            and not _matches(name, self.optional)
        ]
        unexpected = [n for n in found if n not in shapes and not _matches(n, self.ignored)]
        wrong = [
            f"{n} is {list(found[n])}, the class has {list(shapes[n])}"
            for n in found
            if n in shapes and tuple(found[n]) != tuple(shapes[n])
        ]
        parts = []
        if missing:
            parts.append(f"missing {few(missing)}")
        if unexpected:
            parts.append(f"not {self.architecture}'s: {few(unexpected)}")
        if wrong:
            parts.append(f"other shapes: {few(wrong, 3)}")
        return "; ".join(parts) or None

    def prefix_of(self, found: Iterable[str]) -> str | None:
        """The submodule name under which ``found`` holds this class's names (``lm`` for
        ``lm.transformer.h.0...``), or None when there is no such name."""
        counts: dict[str, int] = {}
        for name in found:
            parts = name.split(".")
            for cut in range(1, len(parts)):
                if ".".join(parts[cut:]) in self.shapes:
                    prefix = ".".join(parts[:cut])
                    counts[prefix] = counts.get(prefix, 0) + 1
        return max(counts, key=lambda p: (counts[p], -len(p))) if counts else None


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(pattern, name) for pattern in patterns)


def few(items: Iterable[str], n: int = 5) -> str:
    """At most ``n`` items, sorted, then how many more."""
    items = sorted(items)
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def architecture_class(config: Any) -> type:
    """The transformers class a config's ``architectures`` names (a causal LM of its model type
    when it names none). Only transformers' own classes: custom code is never loaded."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = getattr(config, "architectures", None) or []
    name = names[0] if names else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if not name:
        raise Unverifiable(
            f"its config names no architecture, and model type {config.model_type!r} has no "
            "causal LM class in transformers"
        )
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type):
        raise Unverifiable(
            f"its config names the architecture {name!r}, which transformers "
            f"{transformers.__version__} does not have (forge never loads custom model code)"
        )
    return cls


def expected_weights(config: Any) -> ExpectedWeights:
    """The names and shapes the config's architecture class has, built on the meta device
    (no memory, no initialisation that touches global state)."""
    import torch

    if getattr(config, "quantization_config", None):
        raise Unverifiable("its weights are quantized; their names and shapes are the quantizer's")
    cls = architecture_class(config)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:  # a config the class cannot be built from
        raise ArchitectureError(f"{cls.__name__} cannot be built from its config: {exc}") from exc
    state = model.state_dict(keep_vars=True)
    by_tensor: dict[int, set[str]] = {}
    for name, tensor in state.items():
        by_tensor.setdefault(id(tensor), set()).add(name)
    aliases = {name: set(names) for names in by_tensor.values() for name in names}
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        aliases.setdefault(target, set()).add(source)
        aliases.setdefault(source, set()).add(target)
    optional = [*(model._keys_to_ignore_on_load_missing or ())]
    optional += [
        re.escape(k) + "$" for k in (getattr(model, "_keys_to_ignore_on_save", None) or ())
    ]
    expected = ExpectedWeights(
        architecture=cls.__name__,
        shapes={name: tuple(tensor.shape) for name, tensor in state.items()},
        aliases=aliases,
        optional=optional,
        ignored=[*(model._keys_to_ignore_on_load_unexpected or ())],
    )
    expected.saved_shapes = _saved_shapes(model, state)
    return expected


def _saved_shapes(model: Any, state: Mapping[str, Any]) -> dict | None:
    """The names ``save_pretrained`` writes when they are not the in-memory ones (fused
    mixture-of-experts weights written per expert), or None."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    seen: set[int] = set()
    kept = {}
    for name, tensor in state.items():  # one name per tied tensor, as save_pretrained keeps
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept[name] = tensor
    try:
        reverted = revert_weight_conversion(model, dict(kept))
    except Exception:  # noqa: BLE001 - a conversion that cannot run on meta: in-memory names only
        return None
    if set(reverted) == set(kept):
        return None
    return {name: tuple(tensor.shape) for name, tensor in reverted.items()}


def read_config(path: Path) -> Any:
    """A transformers config from a ``config.json`` file (its model type's own class; a config
    that needs custom code is refused)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ArchitectureError(f"{path}: unreadable ({exc})") from exc
    return config_from_dict(data, str(path))


def config_from_dict(data: Any, where: str) -> Any:
    """The transformers config a ``to_dict()`` dict describes."""
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise Unverifiable(
            f"{where}: model type {model_type!r} is not one transformers knows "
            "(forge never loads custom model code)"
        )
    return CONFIG_MAPPING[model_type].from_dict(data)


@functools.lru_cache(maxsize=4)
def expected_for_config_text(text: str) -> ExpectedWeights:
    """expected_weights of a config.json's text; a training run writes the same one at every
    save, so its class is built once."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ArchitectureError(f"{CONFIG_NAME} is not JSON ({exc})") from exc
    return expected_weights(config_from_dict(data, CONFIG_NAME))
