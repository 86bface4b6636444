"""The user documentation as the tests read it: README.md and every docs/*.md page.

Tests find an example by what it starts with (the ```yaml block whose first line is
``# templates/configs/sgd.yaml``, the output shown after ``$ forge train broken --dry-run``, the
```bash block that starts with ``forge new demo_cls``) in whichever page holds it, so an example
keeps being run when it moves from one page to another. Each example is shown once: a look-up
fails when no page or more than one shows it, so no example is run twice.
"""

from __future__ import annotations

import re
import shlex

from tests.helpers import REPO

PAGE_PATHS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGES = {path.relative_to(REPO).as_posix(): path.read_text() for path in PAGE_PATHS}


def find(pattern: str, what: str) -> re.Match:
    """The one match of ``pattern`` (re.S) in the pages; fails unless exactly one page shows it."""
    found = [
        (name, match) for name, text in PAGES.items() for match in re.finditer(pattern, text, re.S)
    ]
    names = ", ".join(PAGES)
    assert found, f"no page ({names}) shows {what}"
    where = ", ".join(name for name, _ in found)
    assert len(found) == 1, f"{what} is shown {len(found)} times ({where}); show it once"
    return found[0][1]


def block(lang: str, first_line: str) -> str:
    """The ```lang block whose first line is ``first_line``: the text after that line."""
    pattern = r"```" + lang + r"\n" + re.escape(first_line) + r"\n(.*?)```"
    return find(pattern, f"a {lang} block starting with {first_line!r}").group(1)


def block_from(lang: str, first_line: str) -> str:
    """The ```lang block whose first line is ``first_line``, that line included."""
    pattern = r"```" + lang + r"\n(" + re.escape(first_line) + r"\n.*?)```"
    return find(pattern, f"a {lang} block starting with {first_line!r}").group(1)


def output(command: str) -> str:
    """What a page shows after ``$ command``, to the end of its block (the last newline kept)."""
    pattern = r"\$ " + re.escape(command) + r"\n(.*?)```"
    return find(pattern, f"the output of {command!r}").group(1)


def commands(first: str) -> list[list[str]]:
    """The ``forge ...`` lines of the ```bash block whose first line starts with ``first``,
    each split into its arguments (without ``forge``)."""
    pattern = r"```bash\n(" + re.escape(first) + r".*?)```"
    text = find(pattern, f"a bash block starting with {first!r}").group(1)
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("forge ")]


def section(heading: str) -> str:
    """The text under the heading ``heading`` (any level), up to the next heading of the same
    or a higher level (lines inside fenced blocks are not headings)."""
    match = find(r"(?m)^(#+) " + re.escape(heading) + r"\n", f"a heading {heading!r}")
    level = len(match.group(1))
    lines, fenced = [], False
    for line in match.string[match.end() :].splitlines(keepends=True):
        fenced ^= line.lstrip().startswith("```")
        heading_here = re.match(r"(#+) ", line)
        if not fenced and heading_here and len(heading_here.group(1)) <= level:
            break
        lines.append(line)
    return "".join(lines)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block of a page: (its language, its text)."""
    return re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M)
