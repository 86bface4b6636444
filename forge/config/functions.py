"""Functions every template can call (besides Jinja's `range` and `dict`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TEMPLATE_FUNCTIONS: dict[str, Callable[..., Any]] = {}
