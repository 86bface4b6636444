"""Small text helpers for messages, shared by every layer (the template language, the
trainers, the commands). Nothing here imports anything of forge's or torch."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["short_list"]


def short_list(names: Iterable[str], limit: int = 20) -> str:
    """Comma-separated names, cut after `limit` with a count of the rest."""
    names = list(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
