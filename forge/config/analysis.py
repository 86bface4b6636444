"""What each template of a render reads, sets, defaults and overrides, found in its syntax
tree; and the mistakes Jinja would let pass silently.

Jinja drops a child's block that no parent defines, renders a key written at column 0
inside an indented block as a new top-level key, and ignores a variable no template
reads. forge reports each of these, located, after a render.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from jinja2 import nodes

from .errors import Problem, display_path, suggestion
from .syntax import ANY_MARK_RE

_KEY_LINE_RE = re.compile(r"""^(\s*)(?:[A-Za-z_.][\w.\-]*|"[^"]*"|'[^']*')\s*:(?:\s|$)""")


@dataclass
class Block:
    """One `-- block` of a template: where it starts and its own (not nested) text lines."""

    name: str
    line: int
    nested: bool
    text_lines: list[tuple[int, str]] = field(default_factory=list)

    def indent(self) -> int | None:
        """Indentation of its first text line, or None when it writes no text itself."""
        for _, text in self.text_lines:
            return len(text) - len(text.lstrip())
        return None


@dataclass
class Reference:
    """A variable a template touches: read, set (`-- set`) or given a `| default(...)`."""

    name: str
    line: int
    kind: str  # "read", "set" or "default"
    value: str | None = None  # the default's or the set value's text, when it is a constant


@dataclass
class TemplateInfo:
    """The facts about one template that the checks after a render need."""

    name: str
    file: str
    extends: str | None = None
    blocks: list[Block] = field(default_factory=list)
    references: list[Reference] = field(default_factory=list)
    local_names: set[str] = field(default_factory=set)  # loop targets, macro arguments, ...

    def block_names(self) -> set[str]:
        return {b.name for b in self.blocks}

    def reads(self) -> set[str]:
        return {r.name for r in self.references if r.kind in ("read", "default")}


def analyze(tree: nodes.Template, name: str, file: str, source: str) -> TemplateInfo:
    """The facts about a parsed template (`source`: its Jinja text, lines as in the file)."""
    lines = source.split("\n")
    info = TemplateInfo(name, file)
    for node in tree.find_all(nodes.Extends):
        if isinstance(node.template, nodes.Const) and isinstance(node.template.value, str):
            info.extends = node.template.value
    _collect_blocks(tree.body, info, lines, nested=False)
    info.references = _references(tree)
    info.local_names = _local_names(tree)
    return info


def _local_names(tree: nodes.Template) -> set[str]:
    """Names a template binds itself other than by `-- set`: these are not variables."""
    found = {"loop", "super", "self", "caller", "varargs", "kwargs"}
    for node in tree.find_all((nodes.For, nodes.Macro, nodes.CallBlock, nodes.Import)):
        if isinstance(node, nodes.For):
            found |= {n.name for n in node.target.find_all(nodes.Name)}
            if isinstance(node.target, nodes.Name):
                found.add(node.target.name)
        elif isinstance(node, (nodes.Macro, nodes.CallBlock)):
            found |= {arg.name for arg in node.args}
            if isinstance(node, nodes.Macro):
                found.add(node.name)
        else:
            found.add(node.target)
    for node in tree.find_all(nodes.FromImport):
        found |= {n[1] if isinstance(n, tuple) else n for n in node.names}
    return found


def _collect_blocks(body: list[nodes.Node], info: TemplateInfo, lines: list[str], nested: bool):
    for node in _own_nodes(body):
        if isinstance(node, nodes.Block):
            block = Block(node.name, node.lineno, nested, _text_lines(node.body, lines))
            info.blocks.append(block)
            _collect_blocks(node.body, info, lines, nested=True)


def _own_nodes(body: list[nodes.Node]) -> Iterable[nodes.Node]:
    """Every node under `body`, not descending into blocks (which are yielded)."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, nodes.Block):
            stack.extend(reversed(list(node.iter_child_nodes())))


def _text_lines(body: list[nodes.Node], lines: list[str]) -> list[tuple[int, str]]:
    """(line, source line) for each line of literal text a block writes itself."""
    found: dict[int, str] = {}
    for node in _own_nodes(body):
        if isinstance(node, nodes.TemplateData):
            for offset, piece in enumerate(node.data.split("\n")):
                number = node.lineno + offset
                if piece.strip() and 0 < number <= len(lines):
                    found.setdefault(number, ANY_MARK_RE.sub("", lines[number - 1]))
    return sorted(found.items())


def _references(tree: nodes.Template) -> list[Reference]:
    refs: list[Reference] = []
    defaulted: set[int] = set()
    for node in tree.find_all(nodes.Filter):
        if node.name in ("default", "d") and isinstance(node.node, nodes.Name):
            defaulted.add(id(node.node))
            value = _constant_text(node.args[0]) if node.args else "''"
            refs.append(Reference(node.node.name, node.lineno, "default", value))
    for node in tree.find_all(nodes.Assign):
        if isinstance(node.target, nodes.Name):
            refs.append(Reference(node.target.name, node.lineno, "set", _constant_text(node.node)))
    for node in tree.find_all(nodes.Name):
        if node.ctx == "load" and id(node) not in defaulted:
            refs.append(Reference(node.name, node.lineno, "read"))
    return sorted(refs, key=lambda r: r.line)


def _constant_text(node: nodes.Node) -> str | None:
    """`repr`-like text of a constant expression, or None."""
    if isinstance(node, nodes.Filter) and node.name in ("default", "d") and node.args:
        return _constant_text(node.args[0])
    try:
        value = node.as_const()
    except (nodes.Impossible, Exception):  # not a constant, or fails to fold
        return None
    return "none" if value is None else repr(value) if isinstance(value, str) else str(value)


def check_inheritance(infos: dict[str, TemplateInfo], used: Iterable[str]) -> list[Problem]:
    """Blocks no parent defines, and keys written less indented than the block they fill."""
    problems: list[Problem] = []
    for name in used:
        info = infos.get(name)
        parents = _ancestors(info, infos) if info and info.extends else None
        if not parents:
            continue  # no parent, or one named by an expression; nothing to compare
        parent_blocks = {b.name: (p, b) for p in reversed(parents) for b in p.blocks}
        for block in info.blocks:
            if block.name in parent_blocks:
                parent, parent_block = parent_blocks[block.name]
                problems.extend(_misindented(info, block, parent, parent_block))
            elif not block.nested:  # a nested one is new content of the block around it
                problems.append(_unknown_block(info, block, parents))
    return problems


def variables_read(infos: dict[str, TemplateInfo], used: Iterable[str]) -> set[str]:
    """Every name the templates `used` (of `infos`) read, defaults included."""
    read: set[str] = set()
    for name in used:
        if name in infos:
            read |= infos[name].reads()
    return read


def unused_variables(
    variables: Iterable[str], read: set[str], scope: str = "template of this config"
) -> list[Problem]:
    """A problem for each `-D` variable not in `read`."""
    return [
        Problem(
            f"-D {var}: no {scope} reads a variable {var!r}, so it would change nothing"
            f"{suggestion(var, read)}",
            hint="`forge vars CONFIG` lists the variables a config reads",
        )
        for var in variables
        if var not in read
    ]


def _ancestors(info: TemplateInfo, infos: dict[str, TemplateInfo]) -> list[TemplateInfo] | None:
    """Parents, nearest first; None when one of them is not known statically."""
    found: list[TemplateInfo] = []
    current = info
    while current.extends:
        parent = infos.get(current.extends)
        if parent is None or parent is info or any(parent is f for f in found):
            return None
        found.append(parent)
        current = parent
    return found


def _unknown_block(info: TemplateInfo, block: Block, parents: list[TemplateInfo]) -> Problem:
    names = sorted({b.name for p in parents for b in p.blocks})
    chain = ", ".join(repr(p.name) for p in parents)
    return Problem(
        f"block {block.name!r} is not defined in any parent template ({chain}), "
        f"so its content would be dropped{suggestion(block.name, names)}",
        file=info.file,
        line=block.line,
        hint=f"blocks the parents define: {', '.join(names)}" if names else None,
    )


def _misindented(
    info: TemplateInfo, block: Block, parent: TemplateInfo, parent_block: Block
) -> list[Problem]:
    expected = parent_block.indent()
    if not expected:
        return []
    for line, text in block.text_lines:
        match = _KEY_LINE_RE.match(text)
        if match and len(match.group(1)) < expected:
            key = text.strip().split(":", 1)[0]
            return [
                Problem(
                    f"key {key!r} is written at column {len(match.group(1))} inside block "
                    f"{block.name!r}, whose text in {parent.name!r} is indented by {expected}; "
                    "it would become a key of an outer mapping instead of overriding one in "
                    "the block",
                    file=info.file,
                    line=line,
                    hint=f"indent it by {expected} spaces, as in "
                    f"{display_path(parent.file)}:{parent_block.line}",
                    context=f"{line} | {text}",
                )
            ]
    return []
