"""Variables that a render reads only into keys that a later key replaces.

`-D weight_decay=0.1` is read by base.yaml's `weight_decay: {{ weight_decay | default(0.0) }}`;
when a child then writes `weight_decay: 0.0` in the same mapping, YAML keeps the child's key
and the `-D` changes nothing. Found after the render, from the rendered YAML (which pairs a
later key replaces) and the provenance of each rendered line (which template line wrote it).
A variable counts as read into replaced keys only when every template line that reads it
wrote rendered lines, all of them in replaced pairs; a variable read by a statement
(`-- set`, `-- if`) or passed on to a macro is never reported, since where its value goes is
not known.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import yaml

from .analysis import TemplateInfo
from .yaml_io import compose

_MERGE = "tag:yaml.org,2002:merge"


@dataclass(frozen=True)
class ReplacedRead:
    """A template line that reads a variable, and the rendered line of the key that
    replaced what it wrote."""

    file: str
    line: int
    replaced_by: int


def replaced_pairs(text: str) -> dict[int, int]:
    """Rendered line (1-based) -> the line of the key that replaces the pair it belongs to,
    for every line of a mapping pair that a later pair with the same key replaces (and that
    no alias reaches)."""
    try:
        root = compose(text)
    except yaml.YAMLError:
        return {}
    if root is None:
        return {}
    reached = _reach_counts(root)
    replaced: dict[int, int] = {}
    for node in _mappings(root):
        pairs = node.value
        last = {_ident(key): index for index, (key, _) in enumerate(pairs)}
        for index, (key, value) in enumerate(pairs):
            ident = _ident(key)
            if key.tag == _MERGE or last[ident] == index or _shared(value, reached):
                continue
            winner = pairs[last[ident]][0].start_mark.line + 1
            end = pairs[index + 1][0].start_mark.line  # the line before the next pair
            for line in range(key.start_mark.line + 1, end + 1):
                replaced.setdefault(line, winner)
    return replaced


def replaced_reads(
    infos: Mapping[str, TemplateInfo],
    source_map: Mapping[int, tuple[str, int] | None],
    text: str,
    names: Iterable[str] | None = None,
) -> dict[str, list[ReplacedRead]]:
    """Each variable (of `names`, default: every one read) whose every reading line wrote
    only replaced pairs: the reading lines and the keys that replaced them."""
    written: dict[tuple[str, int], list[int]] = {}
    for number, origin in source_map.items():
        if origin is not None:
            written.setdefault(origin, []).append(number)
    reads: dict[str, set[tuple[str, int]]] = {}
    for info in infos.values():
        for ref in info.references:
            if ref.kind in ("read", "default"):
                reads.setdefault(ref.name, set()).add((info.file, ref.line))
    wanted = set(reads) if names is None else set(names) & set(reads)
    replaced = replaced_pairs(text) if wanted else {}
    found: dict[str, list[ReplacedRead]] = {}
    for name in sorted(wanted):
        lines = sorted(reads[name])
        rendered = [(origin, written.get(origin, [])) for origin in lines]
        if all(numbers and all(n in replaced for n in numbers) for _, numbers in rendered):
            found[name] = [
                ReplacedRead(file, line, replaced[numbers[0]]) for (file, line), numbers in rendered
            ]
    return found


def _ident(key: yaml.Node) -> object:
    return (key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key)


def _mappings(root: yaml.Node) -> Iterable[yaml.MappingNode]:
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            yield node
            stack.extend(item for pair in node.value for item in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def _reach_counts(root: yaml.Node) -> dict[int, int]:
    """How many places each node is reached from (more than one: an alias shares it)."""
    counts: dict[int, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        counts[id(node)] = counts.get(id(node), 0) + 1
        if counts[id(node)] > 1:
            continue
        if isinstance(node, yaml.MappingNode):
            stack.extend(item for pair in node.value for item in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return counts


def _shared(node: yaml.Node, reached: dict[int, int]) -> bool:
    """Whether `node` or a node inside it is reached from elsewhere too (an alias)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if reached.get(id(current), 0) > 1:
            return True
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, yaml.MappingNode):
            stack.extend(item for pair in current.value for item in pair)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
    return False
