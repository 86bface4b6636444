"""Projects: a directory with meta.yaml and templates/configs/*.yaml."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import forge
from forge.suggest import did_you_mean, offer, suggestion

from .errors import ConfigError, Problem
from .yaml_io import describe_yaml_error

logger = logging.getLogger(__name__)

META_FILE = "meta.yaml"


def _library_dir() -> Path:
    """forge's template library: `forge/templates` in an installed package, else the
    `templates/` directory beside the `forge` package of a source tree (or an editable
    install of one). Looked up on disk next to the imported forge, never through the
    import system, so a source tree never picks up the library of another install."""
    package = Path(forge.__file__).resolve().parent
    installed = package / "templates"
    root = package.parent
    if not installed.is_dir() and (root / "pyproject.toml").is_file():
        return root / "templates"
    return installed


LIBRARY_DIR = _library_dir()
META_KEYS = (
    "name",
    "description",
    "default_config",
    "search_paths",
    "code_paths",
    "allowed_modules",
)
CONFIG_SUFFIXES = (".yaml", ".yml")


@dataclass
class Project:
    """A forge project as described by its meta.yaml."""

    root: Path
    name: str
    description: str = ""
    default_config: str | None = None
    search_paths: list[Path] = field(default_factory=list)
    code_paths: list[Path] = field(default_factory=list)
    allowed_modules: list[str] = field(default_factory=list)

    @property
    def templates_dir(self) -> Path:
        return self.root / "templates"

    @property
    def configs_dir(self) -> Path:
        return self.root / "templates" / "configs"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def meta_file(self) -> Path:
        return self.root / META_FILE

    @property
    def template_roots(self) -> list[Path]:
        """Where templates are looked up, first match wins."""
        return [self.templates_dir, *self.search_paths, LIBRARY_DIR]

    @property
    def code_roots(self) -> list[Path]:
        """Directories `./file.py:Name` specs may load from: the project, its search paths
        and its code paths."""
        return [self.root, *self.search_paths, *self.code_paths]

    def list_configs(self) -> list[str]:
        """Config names relative to templates/configs, sorted (`["sub/x.yaml", "train.yaml"]`)."""
        if not self.configs_dir.is_dir():
            return []
        return sorted(
            p.relative_to(self.configs_dir).as_posix()
            for p in self.configs_dir.rglob("*")
            if p.is_file() and p.suffix in CONFIG_SUFFIXES
        )

    def resolve_config_name(self, name: str) -> str:
        """Canonical config name for `train`, `train.yaml` or `configs/train.yaml`."""
        available = self.list_configs()
        candidate = name.replace("\\", "/")
        for prefix in ("templates/configs/", "configs/"):
            if candidate.startswith(prefix):
                candidate = candidate[len(prefix) :]
        tries = [candidate] + [candidate + s for s in CONFIG_SUFFIXES]
        for t in tries:
            if t in available:
                return t
        stems = {c.rsplit(".", 1)[0]: c for c in available}
        close = did_you_mean(candidate, list(available) + list(stems))
        close = list(dict.fromkeys(stems.get(c, c) for c in close))
        hint = offer(close) or None
        listing = ", ".join(available) if available else "none"
        raise ConfigError(
            Problem(
                f"no config '{name}' in {self.configs_dir} (available: {listing})",
                hint=hint,
            )
        )


def load_project(root: str | Path) -> Project:
    """Read and validate `root/meta.yaml`."""
    given, root = root, Path(root).resolve()
    meta_file = root / META_FILE
    if not root.exists():
        raise ConfigError(
            Problem(
                f"no such directory: {given}",
                hint="give -p the directory of a project (the one with meta.yaml); "
                "`forge new NAME` creates one",
            )
        )
    if not root.is_dir():
        raise ConfigError(
            Problem(
                f"{given} is a file, not a project directory",
                hint="give -p the directory that holds the project's meta.yaml",
            )
        )
    if not meta_file.is_file():
        raise ConfigError(
            Problem(f"{root} is not a forge project: no {META_FILE}", hint="create meta.yaml")
        )
    text = _read_text(meta_file)
    try:
        meta = yaml.safe_load(text)
    except yaml.YAMLError as err:
        message, line = describe_yaml_error(err, text)
        raise ConfigError(Problem(message, file=str(meta_file), line=line)) from None
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        raise ConfigError(Problem("must be a mapping of settings", file=str(meta_file)))
    problems = []
    for key in meta:
        if key not in META_KEYS:
            problems.append(
                Problem(
                    f"unknown key {key!r}{suggestion(str(key), META_KEYS)}",
                    file=str(meta_file),
                    key_path=str(key),
                    hint="valid keys: " + ", ".join(META_KEYS),
                )
            )

    def strings(key: str) -> list[str]:
        value = meta.get(key) or []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(Problem("must be a list of strings", file=str(meta_file), key_path=key))
            return []
        return value

    def directories(key: str, what: str) -> list[Path]:
        found = []
        for raw in strings(key):
            path = (root / raw).resolve()
            found.append(path)
            if not path.is_dir():
                problems.append(
                    Problem(
                        f"{what} {raw!r} is not a directory ({path})",
                        file=str(meta_file),
                        key_path=key,
                    )
                )
        return found

    search_paths = directories("search_paths", "search path")
    code_paths = directories("code_paths", "code path")
    allowed = strings("allowed_modules")
    for key in ("name", "description", "default_config"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            problems.append(Problem("must be a string", file=str(meta_file), key_path=key))
    if problems:
        raise ConfigError(problems, config=META_FILE)
    return Project(
        root=root,
        name=meta.get("name") or root.name,
        description=meta.get("description") or "",
        default_config=meta.get("default_config"),
        search_paths=search_paths,
        code_paths=code_paths,
        allowed_modules=allowed,
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise ConfigError(
            Problem(f"not UTF-8 text: {err.reason} at byte {err.start}", file=str(path), line=line)
        ) from None
    except OSError as err:
        raise ConfigError(Problem(f"cannot read it: {err.strerror}", file=str(path))) from None


def find_project(start: str | Path | None = None) -> Project:
    """The project in `start` (default: the current directory) or its nearest ancestor."""
    start = Path.cwd() if start is None else Path(start)
    start = start.resolve()
    for directory in (start, *start.parents):
        if (directory / META_FILE).is_file():
            logger.debug("found project at %s", directory)
            return load_project(directory)
    raise ConfigError(
        f"no forge project found in {start} or its parents; pass -p DIR or create meta.yaml"
    )
