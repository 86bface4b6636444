"""Did-you-mean: the one place forge finds the names a mistyped name was meant to be.

Every message that offers a near name (a config key, a template, a callable, a metric, a
module of a pipeline split) asks here, so they all match alike. Nothing here imports torch:
``forge.config`` uses it too.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = ["did_you_mean", "offer", "suggestion"]

CUTOFF = 0.6  # difflib's similarity ratio a candidate needs to be offered


def did_you_mean(
    word: str, candidates: Iterable[str], n: int = 3, cutoff: float = CUTOFF
) -> list[str]:
    """Up to ``n`` close matches of ``word`` among ``candidates``, best first; matched
    without regard to case when nothing matches as written."""
    pool = sorted(set(candidates))
    matches = difflib.get_close_matches(word, pool, n=n, cutoff=cutoff)
    if not matches:
        lowered = {c.lower(): c for c in pool}
        close = difflib.get_close_matches(word.lower(), lowered, n=n, cutoff=cutoff)
        matches = [lowered[m] for m in close]
    return matches


def offer(matches: Sequence[str]) -> str:
    """``did you mean 'a' or 'b'?`` for ``matches``, or the empty string for none."""
    return "did you mean " + " or ".join(repr(m) for m in matches) + "?" if matches else ""


def suggestion(word: str, candidates: Iterable[str], n: int = 3, cutoff: float = CUTOFF) -> str:
    """``"; did you mean 'x'?"`` to append to a message, or the empty string."""
    text = offer(did_you_mean(word, candidates, n, cutoff))
    return f"; {text}" if text else ""
