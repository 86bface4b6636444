"""Resolving a tag's spec (`module:attr.chain`, `./file.py:Name`, `dict`) to a Python object.

Specs are resolved against an allow-list of module roots, so a config can only reach
code the project has opted into. Modules are imported here, never at import of forge.config.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import importlib.util
import logging
import os
import pkgutil
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from forge.extras import missing_package_note
from forge.suggest import did_you_mean, offer, suggestion
from forge.text import short_list

from .errors import display_path
from .project_imports import project_importer

logger = logging.getLogger(__name__)

DEFAULT_ALLOWED_ROOTS: tuple[str, ...] = (
    "forge",
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "safetensors",
    "torchdata",
    "tokenizers",
    "datasets",
    "math",
    "operator",
    "functools",
)
SAFE_BUILTINS = frozenset(
    "dict list tuple set frozenset int float str bool bytes complex len range min max "
    "sum abs round sorted reversed zip enumerate map filter any all slice divmod pow repr "
    "hash isinstance issubclass".split()
)
REFUSED_BUILTINS = frozenset(
    "eval exec compile open __import__ getattr setattr delattr globals locals vars input "
    "breakpoint exit quit help memoryview object type super classmethod staticmethod "
    "property __build_class__".split()
)
_REFUSED_OBJECTS = {id(getattr(builtins, n)) for n in REFUSED_BUILTINS if hasattr(builtins, n)}
_FILE_MODULE_PREFIX = "forge_project_file_"


class SpecError(Exception):
    """A spec that cannot be resolved; `message` and `hint` go into a Problem."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class Spec:
    """A parsed spec: a module or a project file, then an attribute chain."""

    text: str
    module: str | None
    file: str | None
    attrs: tuple[str, ...]

    @property
    def source(self) -> str:
        return self.file or self.module or ""


def parse_spec(text: str) -> Spec:
    """`torch.nn:Linear`, `./model.py:Net.build`, `builtins:dict` or a bare builtin `dict`."""
    if text.startswith(("./", "../")):
        file, sep, attrs = text.rpartition(":")
        if not sep or not file.endswith(".py") or not attrs:
            raise SpecError(f"bad spec {text!r}", "write a project file as ./path/file.py:Name")
        return Spec(text, None, file, tuple(attrs.split(".")))
    module, sep, attrs = text.partition(":")
    if not sep:
        if "." in text or "/" in text:
            head, _, tail = text.rpartition(".")
            raise SpecError(
                f"bad spec {text!r}: separate the module from the attribute with ':'",
                offer([f"{head}:{tail}"]),
            )
        module, attrs = "builtins", text
    if not module or not attrs or "" in attrs.split("."):
        raise SpecError(f"bad spec {text!r}", "write it as module.sub:attr.sub")
    return Spec(text, module, None, tuple(attrs.split(".")))


class Resolver:
    """Resolves specs for one config, caching results (and failures) by spec text."""

    def __init__(
        self,
        project_root: Path | None = None,
        allowed_modules: Iterable[str] = (),
        meta_file: Path | None = None,
        code_roots: Iterable[Path] = (),
    ):
        self.project_root = project_root
        self.allowed = (*DEFAULT_ALLOWED_ROOTS, *allowed_modules)
        self.meta_file = meta_file
        # `./file.py` specs load only from here (the project root when none are given)
        self.code_roots = [Path(r).resolve() for r in code_roots]
        self._cache: dict[str, Any] = {}

    def resolve(self, text: str) -> Any:
        """The object `text` names; raises SpecError."""
        if text not in self._cache:
            try:
                self._cache[text] = self._resolve(parse_spec(text))
            except SpecError as err:
                self._cache[text] = err
        value = self._cache[text]
        if isinstance(value, SpecError):
            raise SpecError(value.message, value.hint)
        return value

    def is_allowed(self, module: str) -> bool:
        return any(module == root or module.startswith(root + ".") for root in self.allowed)

    def _resolve(self, spec: Spec) -> Any:
        if spec.file is not None:
            obj = self._load_file(spec.file)
            where = spec.file
        elif spec.module == "builtins":
            return self._builtin(spec)
        else:
            self._require_allowed(spec.module, spec.text)
            obj = self._import(spec.module)
            where = spec.module
        for attr in spec.attrs:
            obj = self._attribute(obj, attr, where, spec.text)
            where = f"{where}:{attr}" if ":" not in where else f"{where}.{attr}"
        if id(obj) in _REFUSED_OBJECTS:
            raise SpecError(
                f"`{spec.text}` reaches the builtin {obj.__name__}, which forge refuses"
            )
        return obj

    def _require_allowed(self, module: str, text: str) -> None:
        if self.is_allowed(module):
            return
        root = module.split(".")[0]
        raise SpecError(
            f"`{text}` is outside the allowed module roots; add {root!r} to allowed_modules "
            f"in {self._meta_name()} or pass --allow {root}",
            "allowed: " + ", ".join(self.allowed),
        )

    def _meta_name(self) -> str:
        return display_path(self.meta_file) if self.meta_file else "meta.yaml"

    def _builtin(self, spec: Spec) -> Any:
        name = spec.attrs[0]
        if len(spec.attrs) > 1 or not hasattr(builtins, name):
            attrs = ".".join(spec.attrs)
            raise SpecError(f"no builtin {attrs!r}{suggestion(attrs, SAFE_BUILTINS)}")
        if name in SAFE_BUILTINS or (self.is_allowed("builtins") and name not in REFUSED_BUILTINS):
            return getattr(builtins, name)
        hint = "harmless builtins: " + ", ".join(sorted(SAFE_BUILTINS))
        if name in REFUSED_BUILTINS:
            raise SpecError(f"`{spec.text}` is refused: forge never calls the builtin {name}", hint)
        raise SpecError(
            f"`{spec.text}` is not one of the harmless builtins; add 'builtins' to "
            f"allowed_modules in {self._meta_name()} or pass --allow builtins",
            hint,
        )

    def _import(self, module: str) -> ModuleType:
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = err.name or module
            if module == missing or module.startswith(missing + "."):
                note = missing_package_note(missing) or self._module_hint(missing)
                raise SpecError(f"no module named {missing!r}{note}") from None
            raise SpecError(
                f"importing {module!r} failed: {err}{missing_package_note(err.name)}"
            ) from None
        except Exception as err:  # the module's own code failed
            raise SpecError(f"importing {module!r} failed: {type(err).__name__}: {err}") from None

    def _module_hint(self, missing: str) -> str:
        """`; did you mean 'torch.nn'?` among sibling modules, without importing them."""
        parent, _, leaf = missing.rpartition(".")
        if not parent:
            candidates = [r for r in self.allowed if "." not in r and r != leaf]
            close = did_you_mean(leaf, candidates)
        else:
            try:
                package = importlib.import_module(parent)
            except Exception:  # a suggestion is optional
                return ""
            names = [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))]
            names += [n for n, v in vars(package).items() if isinstance(v, ModuleType)]
            close = [f"{parent}.{n}" for n in did_you_mean(leaf, names)]
        return f"; {offer(close)}" if close else ""

    def _attribute(self, obj: Any, attr: str, where: str, text: str) -> Any:
        if attr.startswith("__"):
            raise SpecError(f"`{text}`: forge does not follow dunder attributes ({attr})")
        try:
            value = getattr(obj, attr)
        except AttributeError:
            value = self._submodule(obj, attr)
            if value is None:
                names = [n for n in dir(obj) if not n.startswith("_")]
                close = suggestion(attr, names)
                hint = None if close else "available: " + short_list(sorted(names))
                raise SpecError(f"{where!r} has no attribute {attr!r}{close}", hint) from None
        if isinstance(value, ModuleType) and not self.is_allowed(value.__name__):
            self._require_allowed(value.__name__, text)
        return value

    def _submodule(self, obj: Any, attr: str) -> Any:
        if not isinstance(obj, ModuleType) or not hasattr(obj, "__path__"):
            return None
        try:
            return importlib.import_module(f"{obj.__name__}.{attr}")
        except ModuleNotFoundError:
            return None

    def _require_inside_code_roots(self, file: str, base: Path, path: Path) -> None:
        """Refuse a project file that resolves (links followed) outside the code roots."""
        roots = self.code_roots or [base.resolve()]
        if any(path.is_relative_to(root) for root in roots):
            return
        written = Path(os.path.normpath((base / file).absolute()))
        how = "is a link to" if any(written.is_relative_to(r) for r in roots) else "resolves to"
        relative = os.path.relpath(path.parent, base.resolve())
        raise SpecError(
            f"`{file}` {how} {path}, outside the project directory "
            f"{base}{' and its search and code paths' if len(roots) > 1 else ''}; "
            f"forge loads no code from there",
            f"to allow it, add its directory to code_paths in {self._meta_name()} "
            f"(code_paths: [{relative}])",
        )

    def _load_file(self, file: str) -> ModuleType:
        base = self.project_root or Path.cwd()
        path = (base / file).resolve()
        self._require_inside_code_roots(file, base, path)
        if not path.is_file():
            raise SpecError(f"no file {file!r} (looked for {path})")
        importer = project_importer()  # the project's files import each other by name
        importer.use(self.code_roots or [base])
        imported = importer.loaded(path)
        if imported is not None:  # another project file imported it by name first: one module
            return imported
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
        name = f"{_FILE_MODULE_PREFIX}{path.stem}_{digest}"
        module = sys.modules.get(name)
        mtime = path.stat().st_mtime_ns
        if module is not None and getattr(module, "__forge_mtime__", None) == mtime:
            importer.remember(path, module)
            return module
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise SpecError(f"cannot load {file!r} as Python")
        module = importlib.util.module_from_spec(spec)
        module.__forge_mtime__ = mtime  # type: ignore[attr-defined]
        # what messages call it (forge.wrappers.class_label): the file, not the internal name
        module.__forge_file__ = os.path.normpath(file)  # type: ignore[attr-defined]
        sys.modules[name] = module  # dataclasses and pickling look modules up here
        importer.remember(path, module)  # before it runs: an import cycle gets this module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # the project's own code failed
            sys.modules.pop(name, None)
            importer.forget(path)
            line = getattr(err, "lineno", None) or _line_in(err, path)
            where = f"{file}:{line}" if line else file
            note = missing_package_note(err.name) if isinstance(err, ImportError) else ""
            raise SpecError(f"loading {where} failed: {type(err).__name__}: {err}{note}") from None
        logger.debug("loaded project file %s as %s", path, name)
        return module


def _line_in(err: BaseException, path: Path) -> int | None:
    """The line of ``path`` that the error went through last (its import, say)."""
    line = None
    for frame in traceback.extract_tb(err.__traceback__):
        if frame.filename == str(path):
            line = frame.lineno
    return line
