"""Functions every template can call besides Jinja's `range` and `dict`.

All are pure: none reads, writes or even stats a file. The time functions read the
clock once per render (the render time), so every call in one render agrees.
"""

from __future__ import annotations

import os.path
from collections.abc import Callable
from datetime import datetime
from typing import Any

FUNCTION_NAMES = (
    "joinpath",
    "normpath",
    "basename",
    "dirname",
    "splitext",
    "isotime",
    "filetime",
    "now",
)
FILETIME_FORMAT = "%Y-%m-%dT%H-%M-%S"  # like ISO 8601, without the ':' some file systems refuse


def template_functions(render_time: datetime | None = None) -> dict[str, Callable[..., Any]]:
    """The functions, with `render_time` (default: now, local time) as the render time."""
    started = render_time or datetime.now()

    def moment(timestamp: float | None) -> datetime:
        return started if timestamp is None else datetime.fromtimestamp(float(timestamp))

    def joinpath(*parts: object) -> str:
        """`joinpath(project_dir, 'data', 'x.txt')`: the parts joined with '/'."""
        return os.path.join(*(str(p) for p in parts)) if parts else ""

    def normpath(path: object) -> str:
        """`normpath('a/./b/../c')` -> 'a/c': the path with '.', '..' and '//' folded."""
        return os.path.normpath(str(path))

    def basename(path: object) -> str:
        """`basename('a/b.yaml')` -> 'b.yaml'."""
        return os.path.basename(str(path))

    def dirname(path: object) -> str:
        """`dirname('a/b.yaml')` -> 'a'."""
        return os.path.dirname(str(path))

    def splitext(path: object) -> tuple[str, str]:
        """`splitext('a/b.yaml')` -> ('a/b', '.yaml')."""
        return os.path.splitext(str(path))

    def isotime(timestamp: float | None = None) -> str:
        """ISO 8601 local time to the second of a POSIX timestamp, or of the render time."""
        return moment(timestamp).isoformat(timespec="seconds")

    def filetime(timestamp: float | None = None, format: str = FILETIME_FORMAT) -> str:
        """A timestamp (or the render time) formatted for use in a file name,
        `2025-03-01T14-05-09` by default. It formats a number; it never looks at a file."""
        return moment(timestamp).strftime(format)

    def now(format: str | None = None) -> str:
        """The render time: ISO 8601 to the second, or formatted with `format` (strftime)."""
        return started.isoformat(timespec="seconds") if format is None else started.strftime(format)

    functions = {f.__name__: f for f in (joinpath, normpath, basename, dirname, splitext)}
    functions.update(isotime=isotime, filetime=filetime, now=now)
    return functions
