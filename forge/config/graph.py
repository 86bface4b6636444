"""The object graph: YAML nodes with forge's tags turned into forge nodes.

Construction only reads the YAML tree. Resolving callables happens in check and build,
so a graph can be shown and checked without building anything.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from forge.suggest import suggestion

from .yaml_io import ForgeLoader

logger = logging.getLogger(__name__)

CALL_KINDS = {
    "singleton": "singleton",
    "call": "singleton",
    "factory": "factory",
    "partial": "partial",
}
CONTAINER_KINDS = ("list", "tuple", "dict")
TAG_KINDS = (*CALL_KINDS, "var", *CONTAINER_KINDS)
ARGS_KEY = "_args"
_YAML_MAP = "tag:yaml.org,2002:map"
_YAML_SEQ = "tag:yaml.org,2002:seq"
_YAML_MERGE = "tag:yaml.org,2002:merge"
_VAR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Loc:
    """Where a value sits: its key path, its rendered line, or the --set that gave it."""

    key_path: str
    line: int | None = None
    origin: str | None = None


@dataclass(eq=False)
class Node:
    """A value in the graph that build turns into an object."""

    loc: Loc
    name: str | None = None

    @property
    def key_path(self) -> str:
        return self.loc.key_path


@dataclass(eq=False)
class CallNode(Node):
    """`!singleton:`, `!factory:` or `!partial:` with its arguments."""

    kind: str = "singleton"
    spec: str = ""
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    arg_locs: dict[int | str, Loc] = field(default_factory=dict)


@dataclass(eq=False)
class VarNode(Node):
    """`!var name`: a value supplied at build time."""

    var: str = ""
    default: Any = None
    has_default: bool = False


@dataclass(eq=False)
class ContainerNode(Node):
    """A list, tuple or dict (tagged or plain YAML); shared by aliases within one build."""

    kind: str = "dict"
    items: Any = None  # list for list/tuple, dict for dict
    item_locs: dict[Any, Loc] = field(default_factory=dict)  # where each dict key was written


@dataclass
class GraphProblem:
    """A problem found while constructing the graph; located later by the config."""

    loc: Loc
    message: str
    hint: str | None = None


def join_path(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def iter_children(node: Node) -> list[tuple[Any, Loc | None]]:
    """The values a node refers to, each with its location when it has one."""
    if isinstance(node, CallNode):
        return [(v, node.arg_locs.get(i)) for i, v in enumerate(node.args)] + [
            (v, node.arg_locs.get(k)) for k, v in node.kwargs.items()
        ]
    if isinstance(node, VarNode):
        return [(node.default, None)] if node.has_default else []
    if isinstance(node, ContainerNode):
        values = node.items.values() if node.kind == "dict" else node.items
        return [(v, None) for v in values]
    return []


class GraphConstructor:
    """Turns a composed YAML tree into forge nodes, sharing one node per YAML alias."""

    def __init__(self, override_origins: dict[int, str] | None = None):
        self.override_origins = override_origins or {}
        self.problems: list[GraphProblem] = []
        self.target_locs: dict[str, Loc] = {}  # where each target's key was written
        self._memo: dict[int, Any] = {}
        self._yaml = ForgeLoader("")  # resolves and constructs plain scalars

    def targets(self, root: yaml.Node | None) -> dict[str, Any]:
        """Top-level keys and their values."""
        if root is None:
            return {}
        if not isinstance(root, yaml.MappingNode):
            self._problem(Loc("", _line(root)), "the config must be a mapping of targets")
            return {}
        targets: dict[str, Any] = {}
        for key_node, value_node in self.pairs(root):
            key = str(self._scalar(key_node, ""))
            origin = self.override_origins.get(id(value_node))
            targets[key] = self.construct(value_node, key, origin)
            self.target_locs[key] = Loc(key, None if origin else _line(key_node), origin)
        return targets

    def pairs(self, node: yaml.MappingNode) -> list[tuple[yaml.Node, yaml.Node]]:
        """(key, value) pairs with YAML merge keys (`<<: *base`) expanded first."""
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        explicit = []
        for key_node, value_node in node.value:
            if key_node.tag != _YAML_MERGE:
                explicit.append((key_node, value_node))
                continue
            sources = (
                value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            )
            for source in reversed(sources):
                if isinstance(source, yaml.MappingNode):
                    merged.extend(self.pairs(source))
                else:
                    self._problem(Loc("<<", _line(source)), "a merge key (<<) needs mappings")
        return merged + explicit

    def construct(self, node: yaml.Node, path: str, origin: str | None = None) -> Any:
        if id(node) in self._memo:
            return self._memo[id(node)]
        origin = self.override_origins.get(id(node), origin)
        loc = Loc(path, None if origin else _line(node), origin)
        tag = node.tag or ""
        if tag.startswith("!") and not tag.startswith("!!"):
            kind, _, rest = tag[1:].partition(":")
            if kind in CALL_KINDS:
                return self._call(node, loc, CALL_KINDS[kind], rest)
            if kind == "var":
                return self._var(node, loc, rest)
            if kind in CONTAINER_KINDS:
                return self._container(node, loc, kind, rest)
            self._problem(
                loc,
                f"unknown tag !{kind}{suggestion(kind, TAG_KINDS)}",
                "forge tags: " + ", ".join(f"!{k}" for k in TAG_KINDS),
            )
            return None
        if isinstance(node, yaml.MappingNode) and tag in (_YAML_MAP, ""):
            return self._container(node, loc, "dict", "")
        if isinstance(node, yaml.SequenceNode) and tag in (_YAML_SEQ, ""):
            return self._container(node, loc, "list", "")
        if isinstance(node, yaml.ScalarNode):
            value = self._scalar(node, path)
        else:
            value = self._standard(node, loc)
        self._memo[id(node)] = value
        return value

    def _call(self, node: yaml.Node, loc: Loc, kind: str, rest: str) -> Any:
        spec, _, name = rest.partition("@")
        call = CallNode(loc, name or None, kind=kind, spec=spec)
        self._memo[id(node)] = call
        if not spec:
            self._problem(loc, f"!{kind} needs a callable", f"write it as !{kind}:module:attr")
        path = loc.key_path
        if isinstance(node, yaml.SequenceNode):
            self._positional(call, node, path)
        elif isinstance(node, yaml.MappingNode):
            for key_node, value_node in self.pairs(node):
                key = self._scalar(key_node, path)
                origin = self.override_origins.get(id(value_node), loc.origin)
                line = None if origin else _line(key_node)
                key_loc = Loc(join_path(path, key), line, origin)
                if key == ARGS_KEY:
                    if isinstance(value_node, yaml.SequenceNode):
                        self._positional(call, value_node, key_loc.key_path)
                    else:
                        self._problem(key_loc, f"{ARGS_KEY} must be a list of positional arguments")
                    continue
                call.kwargs[str(key)] = self.construct(value_node, key_loc.key_path, loc.origin)
                call.arg_locs[str(key)] = key_loc
        elif node.value != "":
            call.args.append(self._scalar(node, path))
            call.arg_locs[0] = Loc(join_path(path, 0), _line(node), loc.origin)
        return call

    def _positional(self, call: CallNode, node: yaml.SequenceNode, path: str) -> None:
        for item in node.value:
            index = len(call.args)
            item_path = join_path(path, index)
            call.args.append(self.construct(item, item_path, call.loc.origin))
            call.arg_locs[index] = Loc(item_path, _line(item), call.loc.origin)

    def _var(self, node: yaml.Node, loc: Loc, rest: str) -> VarNode:
        var = VarNode(loc)
        self._memo[id(node)] = var
        if rest:
            self._problem(loc, f"!var takes no suffix (got !var:{rest})", "write !var NAME")
        if isinstance(node, yaml.ScalarNode):
            var.var = str(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key_node, value_node in self.pairs(node):
                key = self._scalar(key_node, loc.key_path)
                if key == "name":
                    var.var = str(self._scalar(value_node, loc.key_path))
                elif key == "default":
                    var.has_default = True
                    var.default = self.construct(
                        value_node, join_path(loc.key_path, "default"), loc.origin
                    )
                else:
                    self._problem(
                        Loc(join_path(loc.key_path, key), _line(key_node), loc.origin),
                        f"!var takes only 'name' and 'default' (got {key!r})",
                    )
        if not _VAR_NAME_RE.match(var.var):
            self._problem(
                loc,
                f"!var needs a variable name (got {var.var!r})",
                "write !var NAME or !var {name: NAME, default: VALUE}",
            )
        return var

    def _container(self, node: yaml.Node, loc: Loc, kind: str, rest: str) -> Any:
        name = rest[1:] if rest.startswith("@") else None
        if rest and not name:
            self._problem(loc, f"!{kind} takes only a name (write !{kind}:@NAME)")
        wants_map = kind == "dict"
        if isinstance(node, yaml.MappingNode) != wants_map or isinstance(node, yaml.ScalarNode):
            if not (isinstance(node, yaml.ScalarNode) and node.value == ""):
                shape = "a mapping" if wants_map else "a sequence"
                self._problem(loc, f"!{kind} needs {shape}")
            container = ContainerNode(loc, name, kind=kind, items={} if wants_map else [])
            self._memo[id(node)] = container
            return container
        container = ContainerNode(loc, name, kind=kind, items={} if wants_map else [])
        self._memo[id(node)] = container
        if wants_map:
            for key_node, value_node in self.pairs(node):
                key = self._scalar(key_node, loc.key_path)
                path = join_path(loc.key_path, key)
                origin = self.override_origins.get(id(value_node), loc.origin)
                container.items[key] = self.construct(value_node, path, loc.origin)
                container.item_locs[key] = Loc(path, None if origin else _line(key_node), origin)
        else:
            for index, item in enumerate(node.value):
                path = join_path(loc.key_path, index)
                container.items.append(self.construct(item, path, loc.origin))
        return container

    def _scalar(self, node: yaml.Node, path: str) -> Any:
        """A plain value; scalars under forge tags are typed as if untagged."""
        if not isinstance(node, yaml.ScalarNode):
            self._problem(Loc(path, _line(node)), "expected a plain value here")
            return None
        tag = node.tag or ""
        if tag.startswith("!") and not tag.startswith("!!"):
            quoted = node.style in ("'", '"', "|", ">")
            tag = self._yaml.resolve(yaml.ScalarNode, node.value, (not quoted, quoted))
            node = yaml.ScalarNode(tag, node.value, node.start_mark, node.end_mark, node.style)
        try:
            return self._yaml.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            self._problem(Loc(path, _line(node)), f"invalid value: {err}")
            return None

    def _standard(self, node: yaml.Node, loc: Loc) -> Any:
        try:
            return self._yaml.construct_object(node, deep=True)
        except yaml.YAMLError as err:
            self._problem(loc, f"invalid value: {getattr(err, 'problem', err)}")
            return None

    def _problem(self, loc: Loc, message: str, hint: str | None = None) -> None:
        self.problems.append(GraphProblem(loc, message, hint))


def _line(node: yaml.Node) -> int | None:
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else None


def walk(values: list[Any]) -> list[Node]:
    """Every node reachable from `values`, each once, parents before children."""
    seen: set[int] = set()
    order: list[Node] = []
    stack = list(reversed(values))
    while stack:
        value = stack.pop()
        if not isinstance(value, Node) or id(value) in seen:
            continue
        seen.add(id(value))
        order.append(value)
        stack.extend(reversed([v for v, _ in iter_children(value)]))
    return order
