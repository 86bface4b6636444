"""forge: inheritable templates to resumable PyTorch training jobs.

The Python API (forge/api.py, docs/python-api.md)::

    import forge

    cfg = forge.render("train", project="projects/tiny_lm", overrides=["trainer.args.max_steps=20"])
    run = forge.train("train", project="projects/tiny_lm", variables={"max_steps": 20})
    model = forge.load(run.run_dir, ema=False, device="cpu")

Names are imported when first used: ``import forge`` loads no torch.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "render": "api",
    "build": "api",
    "resume": "api",
    "load": "api",
    "TrainedRun": "api",
    "CheckpointReader": "read.reader",
    "RunReader": "read.run",
}

__all__ = sorted([*_EXPORTS, "train"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'forge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"forge.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


class _TrainPackage(types.ModuleType):
    """``forge.train`` is the trainers' package (``forge.train.Trainer``, ...) and, called,
    the Python API's ``forge.train(config, ...)`` (forge/api.py): one name, as users expect
    both, so the package module is made callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module("forge.api").train(*args, **kwargs)


# the package's own __init__ is small and imports no torch; every later import of forge.train
# (or of a module in it) finds this callable module
importlib.import_module("forge.train").__class__ = _TrainPackage
