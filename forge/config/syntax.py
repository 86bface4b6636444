"""forge's line syntax, translated to plain Jinja line by line.

Translation keeps the line count, so Jinja's error line numbers are file line numbers.
It also appends an invisible provenance marker to every literal text line; after
rendering the markers are stripped and tell which template line each output line came from.

| line          | becomes                                       |
|---------------|-----------------------------------------------|
| `-- stmt`     | `{% stmt %}`                                  |
| `<< stmt`     | `{%- stmt %}`                                 |
| `>> stmt`     | `{% stmt -%}`                                 |
| `== expr`     | `{{ expr }}` at column 0                      |
| `=> expr`     | `{{ expr }}` at column 0, outer newlines cut  |
| `## text`     | removed (also trailing ` ## text` outside quotes) |
| `#--- name ---` | starts an inline template called `name`     |
| `[name]`      | `{% block name %}`, closed by the next `[other]` line or the template's end |
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARK_OPEN = "\ue000"
MARK_CLOSE = "\ue001"
# Every render signs its markers with a random token, so text a template writes can never
# pass for one (`{{ "\ue0001.2\ue001" }}` is text, not provenance).
ANY_MARK_RE = re.compile(f"{MARK_OPEN}[0-9a-f]*:\\d+\\.\\d+{MARK_CLOSE}")
STRIP_NEWLINES_FILTER = "_forge_strip_newlines"

_LINE_RE = re.compile(r"^(\s*)(--|<<|>>|==|=>) (.*?)\s*$")
_SEPARATOR_RE = re.compile(r"^\s*#-{2,}\s*(\S+)\s*-{2,}\s*$")
_SECTION_RE = re.compile(r"^(\s*)\[([A-Za-z_][A-Za-z0-9_]*)\]$")
_TAG_OPEN = {"{{": "}}", "{%": "%}", "{#": "#}"}
# A quote opens a YAML/Jinja string only at the start of a scalar or an argument.
_QUOTE_OPENERS = set(" \t:[{,(=-?|>")


@dataclass
class SubTemplate:
    """An inline template: its name, the file line it starts on, and its raw lines."""

    name: str
    first_line: int
    lines: list[str]


def split_templates(source: str, main_name: str) -> list[SubTemplate]:
    """The main template followed by every `#--- name ---` template in `source`."""
    lines = source.replace("\r\n", "\n").split("\n")
    parts = [SubTemplate(main_name, 1, [])]
    for number, line in enumerate(lines, start=1):
        match = _SEPARATOR_RE.match(line)
        if match:
            parts.append(SubTemplate(match.group(1), number + 1, []))
        else:
            parts[-1].lines.append(line)
    return parts


def marker(token: str, file_id: int, line: int) -> str:
    """The invisible provenance marker for `line` of file `file_id`, signed with `token`."""
    return f"{MARK_OPEN}{token}:{file_id}.{line}{MARK_CLOSE}"


def translate(part: SubTemplate, file_id: int, token: str = "") -> str:
    """Jinja source for one (sub-)template, starting on its real file line; its markers
    are signed with `token`."""
    out = []
    open_tag: str | None = None  # the closing delimiter we are waiting for, across lines
    in_section = False  # inside a block opened by a `[name]` line
    for offset, raw in enumerate(part.lines):
        number = part.first_line + offset
        section = None if open_tag else _SECTION_RE.match(strip_trailing_comment(raw).rstrip())
        if section:
            indent, name = section.groups()
            close = "{% endblock %}" if in_section else ""
            out.append(f"{indent}{close}{{% block {name} %}}")
            in_section = True
            continue
        line = raw if open_tag else _translate_line(raw)
        open_tag, literal = _scan_tags(line, open_tag)
        if open_tag is None and _wants_marker(line, literal):
            line = line + marker(token, file_id, number)
        out.append(line)
    if in_section:
        out[-1] += "{% endblock %}"
    text = "\n".join(out)
    if part.first_line > 1:
        # A comment spanning the lines above keeps Jinja's line numbers equal to the file's.
        text = "{#" + "\n" * (part.first_line - 1) + "#}" + text
    return text


def _translate_line(line: str) -> str:
    stripped = line.lstrip()
    if stripped.startswith("##"):
        return line[: len(line) - len(stripped)] + "{# #}"
    line = strip_trailing_comment(line)
    match = _LINE_RE.match(line)
    if not match:
        return line
    indent, prefix, body = match.groups()
    if prefix == "--":
        return f"{indent}{{% {body} %}}"
    if prefix == "<<":
        return f"{indent}{{%- {body} %}}"
    if prefix == ">>":
        return f"{indent}{{% {body} -%}}"
    if prefix == "==":
        return f"{{{{ {body} }}}}"
    return f"{{{{ ({body}) | {STRIP_NEWLINES_FILTER} }}}}"


def strip_trailing_comment(line: str) -> str:
    """`line` without a trailing ` ## text` that lies outside single and double quotes."""
    if "##" not in line:
        return line
    quote: str | None = None
    i = 0
    while i < len(line):
        ch = line[i]
        if quote == "'":
            if ch == "'":
                if line[i + 1 : i + 2] == "'":
                    i += 1  # '' is an escaped quote inside single quotes
                else:
                    quote = None
        elif quote == '"':
            if ch == "\\":
                i += 1
            elif ch == '"':
                quote = None
        elif ch in "'\"" and (i == 0 or line[i - 1] in _QUOTE_OPENERS):
            quote = ch
        elif line.startswith("##", i) and i > 0 and line[i - 1] in " \t":
            return line[:i].rstrip()
        i += 1
    return line


def _scan_tags(line: str, open_tag: str | None) -> tuple[str | None, bool]:
    """The closing delimiter still awaited at the end of `line`, given the one at its start,
    and whether the line has literal text outside tags (expressions count as text)."""
    literal = False
    i = 0
    while i < len(line):
        if open_tag is None:
            pair = line[i : i + 2]
            if pair in _TAG_OPEN:
                open_tag = _TAG_OPEN[pair]
                literal = literal or pair == "{{"
                i += 2
                continue
            literal = literal or not line[i].isspace()
        elif line.startswith(open_tag, i):
            open_tag = None
            i += 2
            continue
        i += 1
    return open_tag, literal


def _wants_marker(line: str, literal: bool) -> bool:
    """Whether a marker may follow `line`: it holds YAML text and ends outside any tag.

    A statement or comment line gets none: trim_blocks eats its newline, and a marker there
    would move onto the next line. Neither does a line ending in `-}}` or `-%}`, whose
    whitespace control would stop at the marker. A line with text around a block tag
    (`dtype: {% if fp16 %}half{% endif %}`) gets one, which keeps its newline.
    """
    end = line.rstrip()
    return literal and not end.endswith(("-%}", "-}}"))


def strip_markers(text: str, token: str = "") -> tuple[str, list[tuple[int, int] | None]]:
    """Rendered text without the markers signed with `token`, and per output line the
    first (file id, line) seen."""
    mark_re = re.compile(f"{MARK_OPEN}{re.escape(token)}:(\\d+)\\.(\\d+){MARK_CLOSE}")
    lines = text.split("\n")
    clean = []
    origins: list[tuple[int, int] | None] = []
    for line in lines:
        match = mark_re.search(line)
        origins.append((int(match.group(1)), int(match.group(2))) if match else None)
        clean.append(mark_re.sub("", line) if match else line)
    return "\n".join(clean), origins


def strip_newlines(value: object) -> str:
    """Filter behind `=>`: the value as text without leading and trailing newlines."""
    return str(value).strip("\n")
