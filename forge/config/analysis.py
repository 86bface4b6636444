"""What each template of a render reads, sets, defaults and overrides, found in its syntax
tree; and the mistakes Jinja would let pass silently.

Jinja drops a child's block that no parent defines, a block whose place a parent replaced
(the block around it filled with an `-- include`), and text written outside every block of
a template that extends another; it renders a key written at column 0 inside an indented
block as a new top-level key, and ignores a variable no template reads. forge reports each
of these, located, after a render; which blocks reached the output is observed during the
render (`unrendered_blocks`), not guessed from the template text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from jinja2 import nodes

from forge.suggest import suggestion

from .errors import Problem, display_path
from .syntax import ANY_MARK_RE

_KEY_LINE_RE = re.compile(r"""^(\s*)(?:[A-Za-z_.][\w.\-]*|"[^"]*"|'[^']*')\s*:(?:\s|$)""")
# Statements whose body is not output where they stand: a macro's text is output where it is
# called, a `-- set name` ... `-- endset` block's text is a value.
_NOT_OUTPUT = (nodes.Block, nodes.Macro, nodes.CallBlock, nodes.AssignBlock)
# A text line that is one `{{ ... }}` expression and nothing else.
_EXPRESSION_LINE_RE = re.compile(r"\s*\{\{.*\}\}\s*")


@dataclass
class Block:
    """One `-- block` of a template: where it starts and its own (not nested) text lines."""

    name: str
    line: int
    nested: bool
    text_lines: list[tuple[int, str]] = field(default_factory=list)
    parent: str | None = None  # the block it is written in, None at the top level
    includes: list[str] = field(default_factory=list)  # templates it includes, by name

    def indent(self) -> int | None:
        """Indentation of its first text line, or None when it writes no text itself. A line
        that is one expression alone (`== super()`, written at column 0 because its value
        carries its own indentation) says nothing about the block's indentation."""
        for _, text in self.text_lines:
            if not _EXPRESSION_LINE_RE.fullmatch(text):
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
    # (line, text) written after `-- extends` outside every block: Jinja never outputs it
    outside_text: list[tuple[int, str]] = field(default_factory=list)

    def block_names(self) -> set[str]:
        return {b.name for b in self.blocks}

    def block(self, name: str) -> Block | None:
        return next((b for b in self.blocks if b.name == name), None)

    def reads(self) -> set[str]:
        return {r.name for r in self.references if r.kind in ("read", "default")}


def analyze(tree: nodes.Template, name: str, file: str, source: str) -> TemplateInfo:
    """The facts about a parsed template (`source`: its Jinja text, lines as in the file)."""
    lines = source.split("\n")
    info = TemplateInfo(name, file)
    for node in tree.find_all(nodes.Extends):
        if isinstance(node.template, nodes.Const) and isinstance(node.template.value, str):
            info.extends = node.template.value
    _collect_blocks(tree.body, info, lines, parent=None)
    info.references = _references(tree)
    info.local_names = _local_names(tree)
    info.outside_text = _outside_text(tree, lines)
    return info


def _outside_text(tree: nodes.Template, lines: list[str]) -> list[tuple[int, str]]:
    """(line, text) of what a template outputs after its top-level `-- extends` outside any
    block: Jinja renders the parent instead, so that text would be dropped."""
    found: list[tuple[int, str]] = []
    extended = False
    for statement in tree.body:
        if isinstance(statement, nodes.Extends):
            extended = True
            continue
        if not extended or isinstance(statement, _NOT_OUTPUT):
            continue
        for output in _output_nodes(statement):
            for node in output.nodes:
                line = _first_text_line(node)
                if line is not None:
                    text = ANY_MARK_RE.sub("", lines[line - 1]) if line <= len(lines) else ""
                    found.append((line, text.rstrip()))
    return sorted(set(found))


def _output_nodes(node: nodes.Node) -> Iterable[nodes.Output]:
    """Output nodes under `node`, not looking into blocks, macros and `-- set` blocks."""
    if isinstance(node, nodes.Output):
        yield node
        return
    for child in node.iter_child_nodes():
        if not isinstance(child, _NOT_OUTPUT):
            yield from _output_nodes(child)


def _first_text_line(node: nodes.Node) -> int | None:
    """The line of the first visible output of an output item: text that is not blank (or
    only provenance markers), or any expression."""
    if not isinstance(node, nodes.TemplateData):
        return node.lineno
    data = ANY_MARK_RE.sub("", node.data)
    stripped = data.lstrip()
    if not stripped:
        return None
    return node.lineno + data[: len(data) - len(stripped)].count("\n")


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


def _collect_blocks(
    body: list[nodes.Node], info: TemplateInfo, lines: list[str], parent: str | None
) -> None:
    for node in _own_nodes(body):
        if isinstance(node, nodes.Block):
            block = Block(
                node.name,
                node.lineno,
                parent is not None,
                _text_lines(node.body, lines),
                parent,
                [
                    n.template.value
                    for n in _own_nodes(node.body)
                    if isinstance(n, nodes.Include) and isinstance(n.template, nodes.Const)
                ],
            )
            info.blocks.append(block)
            _collect_blocks(node.body, info, lines, parent=node.name)


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
    """Blocks no parent defines, keys written less indented than the block they fill, and
    text written outside every block of a template that extends another."""
    problems: list[Problem] = []
    for name in used:
        info = infos.get(name)
        if info and info.extends:
            problems.extend(_outside_problems(info, _ancestors(info, infos) or []))
        parents = _ancestors(info, infos) if info and info.extends else None
        if not parents:
            continue  # no parent, or one named by an expression; nothing to compare
        parent_blocks = {b.name: (p, b) for p in reversed(parents) for b in p.blocks}
        for block in info.blocks:
            if block.name in parent_blocks:
                parent, parent_block = parent_blocks[block.name]
                problems.extend(_misindented(info, block, parent, parent_block))
            elif not block.nested:  # a nested one is new content of the block around it
                problems.append(_unknown_block(info, block, parents, infos))
    return problems


def _outside_problems(info: TemplateInfo, parents: list[TemplateInfo]) -> list[Problem]:
    problems = []
    for line, text in info.outside_text:
        key = text.strip().split(":", 1)[0] if _KEY_LINE_RE.match(text) else None
        holders = [
            (block, parent)
            for parent in parents
            for block in parent.blocks
            if key and any(t.strip().split(":", 1)[0] == key for _, t in block.text_lines)
        ]
        if holders:
            block, parent = holders[0]
            hint = (
                f"put it in block {block.name!r}, where {parent.name!r} writes {key!r}: "
                f"`-- block {block.name}`, `    == super()`, the line indented by "
                f"{block.indent()}, `-- endblock`"
            )
        else:
            hint = (
                "put it in one of the blocks of the templates it extends "
                "(`forge render CONFIG --chain` lists them)"
            )
        problems.append(
            Problem(
                f"text outside any block: this template extends {info.extends!r}, whose "
                "text is rendered instead, so this line would be dropped",
                file=info.file,
                line=line,
                hint=hint,
                context=f"{line} | {text}",
            )
        )
    return problems


def unrendered_blocks(
    infos: dict[str, TemplateInfo], contexts: Iterable[tuple[str, set[tuple[str, str]]]]
) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) for blocks a template wrote that never reached the output.

    `contexts` holds, for each template render (the config, each include and import), the
    name of the template rendered and the (template, block) pairs whose text ran. In each,
    the most derived definition of every block should run. One that did not is an error
    when a template at or above it replaced the block around it (its text has no place
    left), and a warning when its place lies in a condition or loop that did not run. A
    template below it that replaced its place did so on purpose, and is not reported.
    """
    errors: dict[tuple[str, int], Problem] = {}
    warnings: dict[tuple[str, int], Problem] = {}
    for name, ran in contexts:
        info = infos.get(name)
        if info is None:
            continue
        parents = _ancestors(info, infos) if info.extends else []
        if parents is None:
            continue  # a parent named by an expression: the chain is not known
        chain = [info, *parents]
        effective: dict[str, tuple[int, TemplateInfo, Block]] = {}
        for index, template in enumerate(chain):
            for block in template.blocks:
                effective.setdefault(block.name, (index, template, block))
        for block_name, (index, template, block) in effective.items():
            if (template.name, block_name) in ran:
                continue
            cut = _cut_off(block_name, chain, effective, ran, set())
            if cut is None or cut.index < index or (cut.condition and cut.index == index):
                continue  # a template below it (or its own condition) left it out
            found = errors if not cut.condition else warnings
            found.setdefault((template.file, block.line), _unrendered(template, block, cut))
    return list(errors.values()), list(warnings.values())


@dataclass
class _Cut:
    """Why a block did not run: the template (at `index` in the chain) that left it out, its
    block that did, and whether the place was there but in a condition or loop that did not
    run (`condition`) or replaced by text without it."""

    index: int
    template: TemplateInfo
    block: Block
    enclosing: str | None
    condition: bool


def _cut_off(
    name: str,
    chain: list[TemplateInfo],
    effective: dict[str, tuple[int, TemplateInfo, Block]],
    ran: set[tuple[str, str]],
    seen: set[str],
) -> _Cut | None:
    """Why block `name` did not run in a render of `chain` (most derived first)."""
    if name in seen:
        return None
    seen.add(name)
    replaced: list[_Cut] = []
    for index, template in enumerate(chain):
        block = template.block(name)
        if block is None:
            continue
        if block.parent is None:  # a place only at the top of the root template
            if template.extends is None:
                return _Cut(index, template, block, None, condition=True)
            continue
        outer_index, outer_template, outer_block = effective[block.parent]
        if outer_template is not template:  # a template below replaced the block around it
            replaced.append(_Cut(outer_index, outer_template, outer_block, block.parent, False))
        elif (template.name, block.parent) in ran:  # it ran, and this place did not
            return _Cut(index, template, block, block.parent, condition=True)
        else:
            return _cut_off(block.parent, chain, effective, ran, seen)
    return min(replaced, key=lambda cut: cut.index, default=None)


def _unrendered(info: TemplateInfo, block: Block, cut: _Cut) -> Problem:
    cutter = cut.template
    where = f"{display_path(cutter.file)}:{cut.block.line}"
    if cut.condition:
        around = f"block {cut.enclosing!r}" if cut.enclosing else "the template"
        return Problem(
            f"block {block.name!r} is not rendered: its place in {around} of "
            f"{cutter.name!r} ({where}) lies in a condition or loop that did not run in "
            "this render, so its content is dropped",
            file=info.file,
            line=block.line,
        )
    included = cut.block.includes
    if included:
        hint = (
            f"{cutter.name!r} fills block {cut.enclosing!r} with -- include "
            f"{included[0]!r}, a render of its own; override {cut.enclosing!r} with an "
            f"include of an inline template that extends {included[0]!r} and overrides "
            f"{block.name!r} there, or change {block.name!r} in {included[0]!r} itself"
        )
    else:
        hint = f"override block {cut.enclosing!r} instead, or put the text there"
    return Problem(
        f"block {block.name!r} never reaches the output: {cutter.name!r} replaces block "
        f"{cut.enclosing!r} ({where}), where a parent renders {block.name!r}, with text "
        f"that has no block {block.name!r}, so this block's content would be dropped",
        file=info.file,
        line=block.line,
        hint=hint,
    )


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


def _unknown_block(
    info: TemplateInfo,
    block: Block,
    parents: list[TemplateInfo],
    infos: dict[str, TemplateInfo],
) -> Problem:
    names = sorted({b.name for p in parents for b in p.blocks})
    chain = ", ".join(repr(p.name) for p in parents)
    hint = f"blocks the parents define: {', '.join(names)}" if names else None
    for parent in parents:  # a parent's block includes a template that defines it
        for outer in parent.blocks:
            for name in outer.includes:
                if name in infos and block.name in infos[name].block_names():
                    hint = (
                        f"{name!r} defines it, but {parent.name!r} includes {name!r} in "
                        f"block {outer.name!r}: a render of its own, whose blocks a config "
                        f"extending {parent.name!r} cannot override; override block "
                        f"{outer.name!r} with an include of an inline template that extends "
                        f"{name!r} and overrides {block.name!r} there"
                    )
    return Problem(
        f"block {block.name!r} is not defined in any parent template ({chain}), "
        f"so its content would be dropped{suggestion(block.name, names)}",
        file=info.file,
        line=block.line,
        hint=hint,
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
