"""Where two rendered configs differ, key by key: what the nodes of one job compare before
they train (forge/launch/endpoint.py), so that a node started with another config, ``-D`` or
``--set`` is named with the keys it differs at instead of training node 0's config.

Each config is read as YAML with its tags kept (``!singleton:torch.nn:Linear`` is part of a
value), later keys winning and anchors expanded, then flattened to ``key.path -> value``.
"""

from __future__ import annotations

from typing import Any

import yaml

from .yaml_io import ForgeLoader

_MAX_DEPTH = 64  # a recursive anchor stops here instead of looping


class _Tagged:
    """A node under one of forge's tags: the tag and what it holds."""

    def __init__(self, tag: str, value: Any) -> None:
        self.tag, self.value = tag, value


class _TagKeepingLoader(ForgeLoader):
    """forge's loader, keeping every ``!tag`` with its value instead of refusing it."""


def _construct_tagged(loader: yaml.Loader, suffix: str, node: yaml.Node) -> _Tagged:
    if isinstance(node, yaml.MappingNode):
        value: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return _Tagged("!" + suffix, value)


_TagKeepingLoader.add_multi_constructor("!", _construct_tagged)


def flat_keys(text: str) -> dict[str, str]:
    """``key.path -> value`` (a tag is the value of its own path) for a rendered config."""
    flat: dict[str, str] = {}
    _flatten(yaml.load(text, Loader=_TagKeepingLoader), "", flat, 0)
    return flat


def _flatten(value: Any, path: str, flat: dict[str, str], depth: int) -> None:
    if depth > _MAX_DEPTH:
        flat[path] = "..."
        return
    if isinstance(value, _Tagged):
        flat[path] = value.tag
        _flatten(value.value, path, flat, depth + 1)
    elif isinstance(value, dict):
        if not value and path:
            flat.setdefault(path, "{}")
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else str(key), flat, depth + 1)
    elif isinstance(value, list):
        if not value:
            flat.setdefault(path, "[]")
        for index, item in enumerate(value):
            _flatten(item, f"{path}[{index}]", flat, depth + 1)
    elif path:
        # a tag's value and its inner scalar share a path: keep both
        flat[path] = f"{flat[path]} {value!r}" if path in flat else repr(value)


def config_differences(ours: str, theirs: str) -> list[tuple[str, str | None, str | None]]:
    """``(key, our value, their value)`` for every key where two rendered configs differ,
    in the order of ``ours`` (then keys only ``theirs`` has); None where a side lacks the key.
    Empty when they render the same values, however differently the text is laid out."""
    if ours == theirs:
        return []
    a, b = flat_keys(ours), flat_keys(theirs)
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]
