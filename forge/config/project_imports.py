"""A project's Python files import each other by name.

``from seqdata import pad_collate`` in a project file finds ``seqdata.py`` in the project
directory (or in its search and code paths, the directories ``./file.py`` specs load from),
``from lib.tokens import X`` finds ``lib/tokens.py``: the names the script of ``forge code``
imports, which puts the project directory on ``sys.path``. Unlike a directory on ``sys.path``,
the project comes after the standard library and the installed packages, so a project file
named like one of them (``datasets.py``) never replaces it for forge or the libraries.

One module per file: a file that a config loads as ``./seqdata.py:...`` and that another file
imports as ``seqdata`` is the same module object (its classes are one class, its globals one
state). One project at a time: when a process builds another project's config (the tests do),
the modules imported by name from the previous project's directories are forgotten, so a
``helpers.py`` of each project is its own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


class _Loaded(importlib.abc.Loader):
    """Gives the import system a module that is already loaded (a ``./file.py`` spec's)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        """Already executed."""


class ProjectImporter(importlib.abc.MetaPathFinder):
    """The finder, last on ``sys.meta_path``, for top-level names found in the code roots."""

    def __init__(self) -> None:
        self.roots: tuple[str, ...] = ()
        self.imported: set[str] = set()  # top-level names it found, to forget on a new project
        self.files: dict[str, ModuleType] = {}  # a loaded ``./file.py``'s path -> its module

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or not self.roots:  # a package's submodules: found by its __path__
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, list(self.roots))
        if spec is None:
            return None
        self.imported.add(name)
        loaded = self.files.get(str(Path(spec.origin).resolve())) if spec.has_location else None
        if loaded is not None:
            return importlib.util.spec_from_loader(name, _Loaded(loaded), origin=spec.origin)
        return spec

    def use(self, roots: Sequence[Path]) -> None:
        """Find names in ``roots`` from now on; forget what other roots gave."""
        wanted = tuple(str(Path(root).resolve()) for root in roots)
        if wanted == self.roots:
            return
        for name in list(sys.modules):
            if name.partition(".")[0] in self.imported:
                del sys.modules[name]
        self.imported.clear()
        self.files.clear()
        self.roots = wanted

    def loaded(self, path: Path) -> ModuleType | None:
        """The module imported by name from ``path``, if another file imported it first."""
        for module in list(sys.modules.values()):
            file = getattr(module, "__file__", None)
            if file and module.__name__.partition(".")[0] in self.imported:
                if Path(file).resolve() == path:
                    return module
        return None

    def remember(self, path: Path, module: ModuleType) -> None:
        """``module`` is ``path`` loaded by a ``./file.py`` spec: importing it by name gives it
        (a module imported under its name from an older version of the file is forgotten)."""
        previous = self.files.get(str(path))
        self.files[str(path)] = module
        if previous is not None and previous is not module:
            for name, value in list(sys.modules.items()):
                if value is previous and name in self.imported:
                    del sys.modules[name]

    def forget(self, path: Path) -> None:
        """``path`` failed to load: importing it by name loads it anew."""
        self.files.pop(str(path), None)


_importer: ProjectImporter | None = None


def project_importer() -> ProjectImporter:
    """The one finder of this process, on ``sys.meta_path`` from its first use."""
    global _importer
    if _importer is None:
        _importer = ProjectImporter()
    if _importer not in sys.meta_path:
        sys.meta_path.append(_importer)
    return _importer
