"""The plain-text tables commands print (``forge runs``, ``forge sweep show``, ...)."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns, two spaces apart, the header first."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells
    ]
    return "\n".join(lines)
