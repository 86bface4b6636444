"""The read side: a checkpoint or run forge wrote, opened as one object (``reader``).

Names are imported lazily, so ``import forge.read`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointReader": "reader",
    "load": "reader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'forge.read' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"forge.read.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
