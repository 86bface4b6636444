"""A callable the trainer was given failing while it trains or evaluates, said as the sanity pass
says it: which part (``trainer.compute_metrics``), what it was doing (the evaluation at step 40),
and where the user's code raised; the launcher adds the config line that sets the part."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from forge.train.sanity import SanityFailure


class UserCodeFailure(RuntimeError):
    """``trainer.<part>`` raised ``error`` while ``doing``; ``where`` (the config line that sets
    the part) is filled in by whoever knows the config (forge/launch/worker.py). A runtime
    failure (exit 1), printed without a traceback (``-v`` shows it)."""

    def __init__(self, part: str, doing: str, error: BaseException) -> None:
        super().__init__(part, doing, error)
        self.part, self.doing, self.error = part, doing, error
        self.where: str | None = None

    def __str__(self) -> str:
        frames = traceback.extract_tb(self.error.__traceback__)
        raised = f" (raised at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})"
        prefix = f"{self.where}: " if self.where else ""
        return (
            f"{prefix}trainer.{self.part} failed while {self.doing}: "
            f"{type(self.error).__name__}: {self.error}{raised if frames else ''}"
        )


def call_user_code(
    part: str, doing: str, function: Callable[..., Any], *args: Any, **kw: Any
) -> Any:
    """``function(*args, **kw)``, its failure a ``UserCodeFailure`` of ``part`` (the sanity
    pass's own failures pass through: it locates them itself)."""
    try:
        return function(*args, **kw)
    except (SanityFailure, UserCodeFailure):
        raise
    except Exception as error:
        raise UserCodeFailure(part, doing, error) from error
