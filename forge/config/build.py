"""Materializing nodes into Python objects, fresh on every build."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .graph import CallNode, ContainerNode, Loc, Node, VarNode, walk

logger = logging.getLogger(__name__)


class CycleError(Exception):
    """A singleton that needs itself to be built."""

    def __init__(self, loc: Loc):
        super().__init__(f"{loc.key_path} depends on itself")
        self.loc = loc


def missing_variables(values: list[Any], variables: Mapping[str, Any]) -> list[VarNode]:
    """`!var` nodes reachable from `values` that have neither a value nor a default."""
    return [
        node
        for node in walk(values)
        if isinstance(node, VarNode) and not node.has_default and node.var not in variables
    ]


class Materializer:
    """Builds values for one `Config.build` call: singletons and containers once, factories
    anew at every place they appear."""

    def __init__(
        self,
        resolve: Callable[[str], Any],
        variables: Mapping[str, Any],
        describe: Callable[[Loc], str],
    ):
        self._resolve = resolve
        self._variables = variables
        self._describe = describe
        self._memo: dict[int, Any] = {}
        self._building: set[int] = set()

    def value(self, value: Any) -> Any:
        if not isinstance(value, Node):
            return value
        if id(value) in self._memo:
            return self._memo[id(value)]
        if isinstance(value, VarNode):
            if value.var in self._variables:
                return self._variables[value.var]
            return self.value(value.default)
        if isinstance(value, ContainerNode):
            return self._container(value)
        assert isinstance(value, CallNode)
        return self._call(value)

    def _container(self, node: ContainerNode) -> Any:
        if node.kind == "tuple":
            result = tuple(self.value(v) for v in node.items)
            self._memo[id(node)] = result
            return result
        if node.kind == "list":
            items: list[Any] = []
            self._memo[id(node)] = items  # registered first so self-references resolve
            items.extend(self.value(v) for v in node.items)
            return items
        mapping: dict[Any, Any] = {}
        self._memo[id(node)] = mapping
        mapping.update((k, self.value(v)) for k, v in node.items.items())
        return mapping

    def _call(self, node: CallNode) -> Any:
        if id(node) in self._building:
            raise CycleError(node.loc)
        self._building.add(id(node))
        try:
            target = self._resolve(node.spec)
            args = [self.value(v) for v in node.args]
            kwargs = {k: self.value(v) for k, v in node.kwargs.items()}
            if node.kind == "partial":
                result = functools.partial(target, *args, **kwargs)
            else:
                try:
                    result = target(*args, **kwargs)
                except Exception as err:
                    # Name the innermost node only; outer nodes would repeat the story.
                    if hasattr(err, "add_note") and not getattr(err, "_forge_located", False):
                        err.add_note(f"while building {self._describe(node.loc)} ({node.spec})")
                        err._forge_located = True  # type: ignore[attr-defined]
                    raise
        finally:
            self._building.discard(id(node))
        if node.kind != "factory":
            self._memo[id(node)] = result
        logger.debug("built %s: %s", node.key_path, node.spec)
        return result
