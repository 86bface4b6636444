"""``forge new`` and ``forge new-config``: projects and configs that render, check and train.

A scaffold is a directory of files under ``forge/scaffolds/KIND/`` copied as they are; only
``meta.yaml`` is written here, with the project's name. Nothing here imports torch.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from forge.cli.exits import UsageError
from forge.config import ConfigError, Project, load_config

SCAFFOLDS_DIR = Path(__file__).parent.parent / "scaffolds"
SCAFFOLDS = {
    "tiny_lm": "a ~1.3M-parameter Llama-style LM on the Python standard library's source",
    "classifier": "an MLP classifier (model.py) on a synthetic, seeded dataset (data.py)",
    "blank": "a config extending base.yaml with its model and datasets left to fill",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "output")


def _check_name(name: str, what: str) -> None:
    if not _NAME_RE.match(name):
        raise UsageError(
            f"{what} name {name!r} must be letters, digits, '_', '-' or '.' "
            "(and not start with '-' or '.')"
        )


def new_project(name: str, parent: Path, kind: str = "tiny_lm") -> Path:
    """Create ``parent/name`` from the scaffold ``kind``; returns the project directory.

    Refuses a target that exists and is not an empty directory (UsageError, nothing written).
    """
    _check_name(name, "project")
    if kind not in SCAFFOLDS:
        raise UsageError(f"unknown scaffold {kind!r}; choose one of: {', '.join(SCAFFOLDS)}")
    target = (Path(parent) / name).resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(
            f"{target} already exists and is not empty; choose another NAME or -p PARENT, "
            "or remove it first"
        )
    shutil.copytree(SCAFFOLDS_DIR / kind, target, ignore=_IGNORED, dirs_exist_ok=True)
    meta = {
        "name": name,
        "description": SCAFFOLDS[kind],
        "default_config": "train.yaml",
    }
    (target / "meta.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    (target / ".gitignore").write_text("output/\n")
    return target


def new_config(project: Project, name: str, extends: str) -> Path:
    """Add ``templates/configs/NAME.yaml`` extending ``extends``; returns its path.

    ``extends`` is a config of the project (``train``, ``train.yaml``) or a template on the
    project's search path (``projects/causal_lm.yaml``). The new config must render.
    """
    stem = name[:-5] if name.endswith(".yaml") else name
    for part in stem.split("/"):
        _check_name(part, "config")
    path = project.configs_dir / f"{stem}.yaml"
    if path.exists():
        raise UsageError(f"{path} already exists; choose another NAME")
    parent = _template_name(project, extends)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"## {stem}: '{parent}' with changes. Override any block of the templates it extends,\n"
        "## written at the indentation of the block it replaces; `== super()` keeps the\n"
        f"## parent's text. `forge render {stem} --chain` lists those templates.\n"
        f"-- extends '{parent}'\n"
    )
    try:
        load_config(project, f"{stem}.yaml")
    except ConfigError:
        path.unlink()
        raise
    return path


def _template_name(project: Project, extends: str) -> str:
    """The template path (as ``-- extends`` reads it) of a project config or library template."""
    configs = project.list_configs()
    try:
        return "configs/" + project.resolve_config_name(extends)
    except ConfigError as err:
        candidate = extends.replace("\\", "/")
        for root in project.template_roots:
            if (root / candidate).is_file():
                return candidate
        listing = ", ".join(configs) or "none"
        raise UsageError(
            f"--extends {extends!r} is neither a config of {project.root} (configs: {listing}) "
            "nor a template on its search path (e.g. 'base.yaml', 'projects/causal_lm.yaml')"
            + (f"; {err.problems[0].hint}" if err.problems and err.problems[0].hint else "")
        ) from None
