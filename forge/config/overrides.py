"""`--set key.path=value`: replacing values in the composed YAML tree.

Paths walk mappings by key and sequences by index, through aliases (an alias is the
same node as its anchor, so overriding through it changes every place that shares it).
Paths are strict: an unknown segment is an error with suggestions, never a new key.
"""

from __future__ import annotations

from collections.abc import Iterable

import yaml

from .errors import ConfigError, Problem, short_list, suggestion
from .yaml_io import compose

_MERGE = "tag:yaml.org,2002:merge"


def split_key_path(path: str) -> list[str]:
    """`a.b.0` -> [a, b, 0]; a leading or doubled dot belongs to a hidden key (`.args.lr`)."""
    segments: list[str] = []
    hidden = False
    for part in path.split("."):
        if part == "":
            hidden = True
            continue
        segments.append("." + part if hidden else part)
        hidden = False
    return segments


def apply_overrides(root: yaml.Node | None, overrides: Iterable[str]) -> dict[int, str]:
    """Apply every override in place; returns `id(node) -> "--set ..."` for the new nodes.

    Raises ConfigError listing every override that does not apply.
    """
    origins: dict[int, str] = {}
    problems: list[Problem] = []
    for text in overrides:
        try:
            new = _apply(root, text)
        except _OverrideError as err:
            message = f"{err.message} (in --set {text})" if err.path else err.message
            problems.append(Problem(message, key_path=err.path, hint=err.hint))
            continue
        for node in _subtree(new):
            origins[id(node)] = f"--set {text}"
    if problems:
        raise ConfigError(problems)
    return origins


class _OverrideError(Exception):
    def __init__(self, message: str, path: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message, self.path, self.hint = message, path, hint


def _apply(root: yaml.Node | None, text: str) -> yaml.Node:
    path, sep, raw = text.partition("=")
    segments = split_key_path(path.strip())
    if not sep or not segments:
        raise _OverrideError(
            f"bad override {text!r}: expected KEY.PATH=VALUE",
            hint="e.g. --set trainer.args.lr=3e-4",
        )
    try:
        new = compose(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise _OverrideError(f"bad value in --set {text!r}: {err}", path=path) from None
    if new is None:
        new = yaml.ScalarNode("tag:yaml.org,2002:null", "null")
    node = root
    walked: list[str] = []
    for i, segment in enumerate(segments):
        container, index = _child(node, segment, walked)
        if i == len(segments) - 1:
            if isinstance(container, yaml.MappingNode):
                key_node, _ = container.value[index]
                container.value[index] = (key_node, new)
            else:
                container.value[index] = new
        else:
            node = (
                container.value[index][1]
                if isinstance(container, yaml.MappingNode)
                else container.value[index]
            )
        walked.append(segment)
    return new


def _child(node: yaml.Node | None, segment: str, walked: list[str]) -> tuple[yaml.Node, int]:
    """The node holding `segment` under `node` (maybe a merged mapping) and its index there."""
    where = ".".join(walked) or "the top level"
    if isinstance(node, yaml.MappingNode):
        found = _find_key(node, segment)
        if found:
            return found
        keys = _keys(node)
        raise _OverrideError(
            f"unknown key {segment!r} in {where}{suggestion(segment, keys)}",
            path=".".join([*walked, segment]),
            hint="keys there: " + short_list(keys) if keys else None,
        )
    if isinstance(node, yaml.SequenceNode):
        if segment.isdigit() and int(segment) < len(node.value):
            return node, int(segment)
        raise _OverrideError(
            f"{where} is a list of {len(node.value)} items; {segment!r} is not an index into it",
            path=".".join([*walked, segment]),
        )
    raise _OverrideError(
        f"{where} is a single value, it has no key {segment!r}",
        path=".".join([*walked, segment]),
    )


def _find_key(node: yaml.MappingNode, segment: str) -> tuple[yaml.Node, int] | None:
    # The last occurrence wins, as when the YAML is read; merged mappings come after.
    for index in range(len(node.value) - 1, -1, -1):
        key_node = node.value[index][0]
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == segment:
            if key_node.tag != _MERGE:
                return node, index
    for key_node, value in node.value:
        if key_node.tag == _MERGE:
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            for source in sources:
                if isinstance(source, yaml.MappingNode):
                    found = _find_key(source, segment)
                    if found:
                        return found
    return None


def _keys(node: yaml.MappingNode) -> list[str]:
    keys: list[str] = []
    for key_node, value in node.value:
        if key_node.tag == _MERGE:
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            keys += [k for s in sources if isinstance(s, yaml.MappingNode) for k in _keys(s)]
        elif isinstance(key_node, yaml.ScalarNode):
            keys.append(key_node.value)
    return list(dict.fromkeys(keys))


def _subtree(node: yaml.Node) -> list[yaml.Node]:
    nodes, stack, seen = [], [node], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        nodes.append(current)
        if isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
        elif isinstance(current, yaml.MappingNode):
            for k, v in current.value:
                stack.extend((k, v))
    return nodes
