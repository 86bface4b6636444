"""The package's import graph, read from the source: no cycles, and the layers point one way.

Every ``import`` statement of every module counts, wherever it is (top level, inside a
function, under ``if TYPE_CHECKING:``): an import moved into a function to dodge a cycle is
still a cycle in how the code is built. A submodule's implicit import of its own package's
``__init__`` does not count (Python runs it first, whatever the code says).
"""

from __future__ import annotations

import ast
from pathlib import Path

import forge

PACKAGE = Path(forge.__file__).parent


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(name: str, path: Path) -> set[str]:
    """The dotted names the module's import statements name (``from a import b`` names
    ``a`` and ``a.b``: ``b`` may be a submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(name, path):
            while imported and imported not in modules:  # a name inside a module: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted, the list sorted: every set of modules that import each other, however far round."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    """The edges inside one cycle, ``a -> b``, so the message says which import to remove."""
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"{' <-> '.join(component)} ({'; '.join(edges)})"


def test_the_reader_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from forge.train.trainer import BaseTrainer\n"
        "def f():\n    from forge.train import integrations\n    from . import sibling\n"
    )
    names = imported_names("forge.train.m", source)
    assert {"forge.train.trainer", "forge.train.integrations", "forge.train.sibling"} <= names
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert describe(["a", "b", "c"], graph) == "a <-> b <-> c (a -> b; b -> c; c -> a)"


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "forge.train.trainer" in graph and graph["forge.train.trainer"]  # the reader reads
    found = [describe(component, graph) for component in cycles(graph)]
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(found)


def test_data_imports_nothing_of_the_trainers():
    graph = import_graph()
    edges = [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if module == "forge.data" or module.startswith("forge.data.")
        for target in sorted(targets)
        if target == "forge.train" or target.startswith("forge.train.")
    ]
    assert not edges, "forge/data imports forge/train:\n" + "\n".join(edges)


def test_config_imports_no_torch():
    """The template language renders and checks without the ML stack: no module forge.config
    reaches through its imports imports torch (user callables are imported by name at check
    time, which no import statement shows)."""
    modules, graph = module_files(), import_graph()
    reached = {name for name in graph if name == "forge.config" or name.startswith("forge.config.")}
    todo = list(reached)
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    heavy = ("torch", "transformers", "accelerate", "numpy", "safetensors")
    found = [
        f"{name} imports {imported}"
        for name in sorted(reached)
        for imported in sorted(imported_names(name, modules[name]))
        if imported.split(".")[0] in heavy
    ]
    assert not found, "\n".join(found)


def test_did_you_mean_has_one_implementation():
    """Only forge/suggest.py matches names by similarity; every message asks it."""
    users = [
        name
        for name, path in module_files().items()
        if "difflib" in {n.split(".")[0] for n in imported_names(name, path)}
    ]
    assert users == ["forge.suggest"]
