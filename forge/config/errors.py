"""Located problems and the error that carries them.

Every mistake forge finds in a project, template or config becomes a `Problem` that
names where it came from (template file and line, or the rendered line with context),
the key path it concerns, and a fix where one fits. Problems are collected and raised
together as one `ConfigError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class Problem:
    """One mistake, located as precisely as forge can locate it."""

    message: str
    file: str | None = None
    line: int | None = None
    key_path: str | None = None
    hint: str | None = None
    context: str | None = None

    @property
    def location(self) -> str | None:
        """`file:line`, `file`, or None; the file relative to cwd when it lies below it."""
        if self.file is None:
            return f"rendered line {self.line}" if self.line is not None else None
        shown = display_path(self.file)
        return f"{shown}:{self.line}" if self.line is not None else shown

    def __str__(self) -> str:
        head = ": ".join(p for p in (self.location, self.key_path, self.message) if p)
        extra = [self.hint] if self.hint else []
        if self.context:
            extra.append(self.context)
        lines = [head]
        for block in extra:
            lines.extend("    " + line for line in block.splitlines())
        return "\n".join(lines)


class ConfigError(Exception):
    """One or more problems in a project, template or config; shown without a traceback."""

    def __init__(self, problems: Problem | str | Iterable[Problem], *, config: str | None = None):
        if isinstance(problems, str):
            problems = [Problem(problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        self.config = config
        super().__init__(self._format())

    def _format(self) -> str:
        if len(self.problems) == 1:
            return str(self.problems[0])
        where = f" in config '{self.config}'" if self.config else ""
        header = f"{len(self.problems)} problems{where}:"
        return "\n".join([header, *(str(p) for p in self.problems)])

    def __str__(self) -> str:
        return self._format()


def display_path(path: str | Path) -> str:
    """`path` relative to the current directory when it lies below it, else as given."""
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def excerpt(lines: list[str], line: int, around: int = 2) -> str:
    """Lines `line - around` .. `line + around` of `lines`, numbered, `line` marked with '>'."""
    first, last = max(1, line - around), min(len(lines), line + around)
    return "\n".join(
        f"{'>' if n == line else ' '} {n:4d} | {lines[n - 1]}" for n in range(first, last + 1)
    )
