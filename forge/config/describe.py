"""A readable view of a config's node graph (`forge render --graph`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .callables import Resolver, SpecError
from .graph import CallNode, ContainerNode, Loc, Node, VarNode


def describe_graph(
    targets: dict[str, Any],
    resolver: Resolver,
    where: Callable[[Loc], str],
    target_locs: dict[str, Loc] | None = None,
) -> str:
    """One line per value: key, tag kind, spec, what it resolves to, and `where(loc)`, the
    template line it came from.

    A node reached again through an alias is shown once and then referred to by the key
    path where it was first shown.
    """
    lines: list[str] = []
    seen: dict[int, str] = {}

    def visit(label: str, value: Any, depth: int, key_loc: Loc | None = None) -> None:
        pad = "  " * depth
        if not isinstance(value, Node):
            location = where(key_loc) if key_loc else ""
            lines.append(f"{pad}{label}: {value!r}" + (f"  [{location}]" if location else ""))
            return
        if id(value) in seen:
            again = "a new object here" if _is_factory(value) else "shared"
            location = where(key_loc) if key_loc else ""
            suffix = f"  [{location}]" if location else ""
            lines.append(f"{pad}{label}: *{seen[id(value)]} ({again}){suffix}")
            return
        seen[id(value)] = value.key_path
        location = where(value.loc)
        suffix = f"  [{location}]" if location else ""
        name = f"@{value.name}" if value.name else ""
        children: list[tuple[str, Any, Loc | None]] = []
        if isinstance(value, CallNode):
            resolved = _resolved(value, resolver)
            lines.append(f"{pad}{label}: {value.kind} {value.spec}{name} -> {resolved}{suffix}")
            children = [(str(i), v, value.arg_locs.get(i)) for i, v in enumerate(value.args)]
            children += [(k, v, value.arg_locs.get(k)) for k, v in value.kwargs.items()]
        elif isinstance(value, VarNode):
            default = ""
            if value.has_default and isinstance(value.default, Node):
                children = [("default", value.default, None)]
            elif value.has_default:
                default = f" (default: {value.default!r})"
            lines.append(f"{pad}{label}: var {value.var}{default}{suffix}")
        elif isinstance(value, ContainerNode):
            lines.append(f"{pad}{label}: {value.kind}{name}{suffix}")
            items = value.items.items() if value.kind == "dict" else enumerate(value.items)
            children = [(str(k), v, value.item_locs.get(k)) for k, v in items]
        for child_label, child, child_loc in children:
            visit(child_label, child, depth + 1, child_loc)

    for target, value in targets.items():
        visit(target, value, 0, (target_locs or {}).get(target))
    return "\n".join(lines)


def _is_factory(node: Node) -> bool:
    return isinstance(node, CallNode) and node.kind == "factory"


def _resolved(node: CallNode, resolver: Resolver) -> str:
    try:
        return repr(resolver.resolve(node.spec))
    except SpecError as err:
        return f"unresolved: {err.message}"
