"""The optional packages forge knows about, and the pip command that installs each.

One table for every message about a missing optional package: a config's
``!call:datasets:load_dataset`` node, a project file that imports one, ``report_to: wandb``,
``forge plot``, or an import that fails while a run builds or trains. Each says what to run.
Packages that come with an extra of forge (pyproject.toml's optional dependencies) are
installed through the extra, the others by name. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util

__all__ = [
    "OPTIONAL_PACKAGES",
    "install_command",
    "is_installed",
    "missing_package_hint",
    "missing_package_note",
]

# import name -> the command that installs it
OPTIONAL_PACKAGES: dict[str, str] = {
    "datasets": "pip install 'forge[datasets]'",
    "matplotlib": "pip install 'forge[plot]'",
    "lightning": "pip install 'forge[lightning]'",
    "optuna": "pip install 'forge[sweep]'",
    "wandb": "pip install wandb",
    "mlflow": "pip install mlflow",
    "tensorboard": "pip install tensorboard",
}


def install_command(module: str | None) -> str | None:
    """The pip command for ``module`` (or a submodule of it), None if forge does not know it."""
    if not module:
        return None
    return OPTIONAL_PACKAGES.get(module.split(".")[0])


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_package_note(module: str | None) -> str:
    """``" (an optional package, not installed: pip install ...)"``, or "" for a module forge
    does not know."""
    command = install_command(module)
    return f" (an optional package, not installed: {command})" if command else ""


def missing_package_hint(err: BaseException) -> str | None:
    """For an ImportError of a package forge knows: what to run."""
    if not isinstance(err, ImportError):
        return None
    command = install_command(getattr(err, "name", None))
    if command is None:
        return None
    return f"{err.name.split('.')[0]} is an optional package that is not installed: {command}"
