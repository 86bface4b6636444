"""`--set key.path=value`: replacing values in the composed YAML tree.

Paths walk mappings by key and sequences by index, through aliases (an alias is the
same node as its anchor, so overriding through it changes every place that shares it).
Paths are strict: an unknown segment is an error with suggestions. The one exception is
the last segment under a call (`!singleton:`, `!factory:`, `!partial:`): a keyword the
callable takes but the YAML does not write is added (`--set
trainer.args.resume_from_checkpoint=PATH`), checked against the callable's signature.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import yaml

from forge.suggest import suggestion
from forge.text import short_list

from .callables import SpecError
from .check import Keywords
from .errors import ConfigError, Problem
from .graph import CALL_KINDS
from .yaml_io import compose

_MERGE = "tag:yaml.org,2002:merge"
_STR = "tag:yaml.org,2002:str"
_MAP = "tag:yaml.org,2002:map"

# The keywords a spec's callable takes (None: no signature to check); raises SpecError.
KeywordLookup = Callable[[str], "Keywords | None"]


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


def apply_overrides(
    root: yaml.Node | None, overrides: Iterable[str], keywords: KeywordLookup | None = None
) -> dict[int, str]:
    """Apply every override in place; returns `id(node) -> "--set ..."` for the new nodes.

    `keywords` lets an override add a keyword argument to a call, also as a mapping that the
    rest of the path fills (``trainer.args.fsdp_config.replicate_size=2``: a mapping the
    overrides create takes any key); without it paths must exist. Raises ConfigError listing
    every override that does not apply.
    """
    origins: dict[int, str] = {}
    problems: list[Problem] = []
    made: set[int] = set()  # the mappings these overrides created
    for text in overrides:
        try:
            new = _apply(root, text, keywords, made)
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


def _apply(
    root: yaml.Node | None, text: str, keywords: KeywordLookup | None, made: set[int]
) -> yaml.Node:
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
        last = i == len(segments) - 1
        value = new if last else yaml.MappingNode(_MAP, [])
        if isinstance(node, yaml.MappingNode) and _find_key(node, segment) is None:
            # a mapping these overrides created takes any key; a call, a keyword it takes
            # (given as a mapping that the rest of the path fills: fsdp_config.replicate_size)
            if id(node) in made:
                node.value.append((yaml.ScalarNode(_STR, segment), value))
            elif not (keywords and _add_keyword(node, segment, value, walked, keywords)):
                value = None
            if value is not None:
                if last:
                    return new
                node = value
                made.add(id(node))
                walked.append(segment)
                continue
        container, index = _child(node, segment, walked)
        if last:
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


def _add_keyword(
    node: yaml.MappingNode,
    key: str,
    value: yaml.Node,
    walked: list[str],
    keywords: KeywordLookup,
) -> bool:
    """Add `key: value` to a call's mapping if its callable takes `key`; False if `node`
    is no call. Raises _OverrideError for a keyword the callable does not take."""
    spec = _call_spec(node)
    if spec is None:
        return False
    where = ".".join(walked) or "the top level"
    path = ".".join([*walked, key])
    try:
        known = keywords(spec)
    except SpecError as err:
        raise _OverrideError(
            f"unknown key {key!r} in {where}, and `{spec}` cannot be checked: {err.message}",
            path=path,
        ) from None
    if known is not None and not known.accepts(key):
        existing = _keys(node)
        candidates = list(dict.fromkeys([*existing, *known.names]))
        raise _OverrideError(
            f"unknown key {key!r} in {where}: `{spec}` takes no keyword {key!r}"
            f"{suggestion(key, candidates)}",
            path=path,
            hint="keywords it takes: " + short_list(known.names) if known.names else None,
        )
    node.value.append((yaml.ScalarNode(_STR, key), value))
    return True


def _call_spec(node: yaml.Node) -> str | None:
    """`module:attr` of a `!singleton:module:attr@name` node, else None."""
    tag = node.tag or ""
    if not tag.startswith("!") or tag.startswith("!!"):
        return None
    kind, _, rest = tag[1:].partition(":")
    spec = rest.partition("@")[0]
    return spec if kind in CALL_KINDS and spec else None


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
