"""`forge render --resolved`: the config as YAML with one value per key and, beside each
key, the template line its winning value came from.

Templates often write a key twice (`== super()` then the override); YAML keeps the later
one. Here every mapping holds each key once, at the place it first appeared, with the
value that wins, so the text reads as what will be built.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import yaml

from .yaml_io import ForgeDumper

_MERGE = "tag:yaml.org,2002:merge"
_STANDARD = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")
_ANCHOR_RE = re.compile(r"[^A-Za-z0-9_-]+")

# (key node, value node) -> `templates/configs/train.yaml:12`, `--set a=1`, or None
Locate = Callable[[yaml.Node, yaml.Node], "str | None"]


def merged_pairs(node: yaml.MappingNode) -> list[tuple[yaml.Node, yaml.Node]]:
    """`node`'s pairs with each key once: at its first place, with its last value."""
    order: dict[object, int] = {}
    pairs: list[tuple[yaml.Node, yaml.Node]] = []
    for key, value in node.value:
        ident = (key.tag, key.value) if isinstance(key, yaml.ScalarNode) else id(key)
        if key.tag == _MERGE or ident not in order:
            order[ident] = len(pairs)
            pairs.append((key, value))
        else:
            pairs[order[ident]] = (key, value)
    return pairs


def resolved_yaml(root: yaml.Node | None, locate: Locate) -> str:
    """Block YAML for `root` with duplicate keys merged and a `# where` comment per key."""
    if root is None:
        return ""
    return _Writer(root, locate).text()


class _Writer:
    def __init__(self, root: yaml.Node, locate: Locate):
        self.root = root
        self.locate = locate
        self.lines: list[str] = []
        self.anchors = self._anchor_names(root)
        self.written: set[int] = set()

    def text(self) -> str:
        if isinstance(self.root, yaml.MappingNode) and self.root.tag in _STANDARD:
            self._mapping_body(self.root, 0)
        else:
            head, inline = self._head(self.root)
            if inline is not None:
                self.lines.append(" ".join(p for p in (head, inline) if p))
            else:
                self.lines.append(head)
                self._body(self.root, 2)
        return "\n".join(self.lines) + "\n"

    def _anchor_names(self, root: yaml.Node) -> dict[int, str]:
        """A readable anchor (the first key it sits under) for each node seen twice."""
        counts: dict[int, int] = {}
        names: dict[int, str] = {}
        stack: list[tuple[yaml.Node, str]] = [(root, "root")]
        while stack:
            node, label = stack.pop()
            counts[id(node)] = counts.get(id(node), 0) + 1
            if counts[id(node)] > 1:
                continue
            names[id(node)] = label
            if isinstance(node, yaml.MappingNode):
                for key, value in reversed(merged_pairs(node)):
                    name = key.value if isinstance(key, yaml.ScalarNode) else "item"
                    stack.append((value, name))
            elif isinstance(node, yaml.SequenceNode):
                for i, item in reversed(list(enumerate(node.value))):
                    stack.append((item, f"{label}_{i}"))
        anchors: dict[int, str] = {}
        taken: set[str] = set()
        for ident, count in counts.items():
            if count > 1:
                base = _ANCHOR_RE.sub("_", names[ident].lstrip(".")).strip("_") or "node"
                name, n = base, 2
                while name in taken:
                    name, n = f"{base}_{n}", n + 1
                taken.add(name)
                anchors[ident] = name
        return anchors

    def _head(self, node: yaml.Node) -> tuple[str, str | None]:
        """(`&anchor !tag` or an alias, the value when it fits on the key's line, else None)."""
        ident = id(node)
        if ident in self.anchors and ident in self.written:
            return f"*{self.anchors[ident]}", ""
        self.written.add(ident)
        parts = [f"&{self.anchors[ident]}"] if ident in self.anchors else []
        if isinstance(node, yaml.ScalarNode):
            parts.append(_scalar(node))
            return " ".join(parts), ""
        if node.tag not in _STANDARD:
            parts.append(_tag(node.tag))
        if not node.value:
            parts.append("{}" if isinstance(node, yaml.MappingNode) else "[]")
            return " ".join(parts), ""
        return " ".join(parts), None

    def _body(self, node: yaml.Node, indent: int) -> None:
        if isinstance(node, yaml.MappingNode):
            self._mapping_body(node, indent)
        else:
            for item in node.value:
                head, inline = self._head(item)
                line = f"{' ' * indent}- {head}".rstrip()
                self.lines.append(line)
                if inline is None:
                    self._body(item, indent + 2)

    def _mapping_body(self, node: yaml.MappingNode, indent: int) -> None:
        for key, value in merged_pairs(node):
            key_text = "<<" if key.tag == _MERGE else _scalar(key)
            head, inline = self._head(value)
            where = self.locate(key, value)
            comment = f"  # {where}" if where else ""
            self.lines.append(f"{' ' * indent}{key_text}: {head}".rstrip() + comment)
            if inline is None:
                self._body(value, indent + 2)


def _tag(tag: str) -> str:
    return tag if tag.startswith("!") else f"!<{tag}>"


def _scalar(node: yaml.ScalarNode) -> str:
    """One line of YAML for a scalar, with its tag where one is needed."""
    style = node.style
    if "\n" in node.value or style in ("|", ">"):
        style = '"'  # one line per key: escape newlines
    copy = yaml.ScalarNode(node.tag, node.value, style=style)
    text = yaml.serialize(
        copy, Dumper=ForgeDumper, allow_unicode=True, width=float("inf"), explicit_end=False
    )
    text = text.rstrip("\n")
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text
