"""`forge vars`: every variable a config's templates read, its value or default, and the
template line that sets or defaults it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .errors import display_path
from .functions import FUNCTION_NAMES
from .render import RenderedConfig
from .sandbox import ALLOWED_GLOBALS


@dataclass(frozen=True)
class VariableRow:
    """One place a variable gets a value: `-D`, forge, a `-- set` or a `| default(...)`."""

    name: str
    value: str = ""
    default: str = ""
    where: str = ""


def variable_rows(
    rendered: RenderedConfig,
    defines: Mapping[str, Any],
    builtins: Mapping[str, Any],
) -> list[VariableRow]:
    """Rows for every variable the render's templates read, sorted by name; a variable with
    several sources (a `-D`, a child's `-- set`, a parent's default) gets one row each."""
    infos = list(rendered.templates.values())
    functions = set(ALLOWED_GLOBALS) | set(FUNCTION_NAMES)
    local = set().union(*(info.local_names for info in infos)) if infos else set()
    names = {
        ref.name
        for info in infos
        for ref in info.references
        if ref.name not in functions and ref.name not in local
    }
    names |= set(defines)
    rows: list[VariableRow] = []
    for name in sorted(names):
        found: list[VariableRow] = []
        if name in defines:
            found.append(VariableRow(name, value=_show(defines[name]), where="-D"))
        if name in builtins:
            found.append(VariableRow(name, value=_show(builtins[name]), where="forge"))
        reads = []
        for info in infos:
            defaulted = {r.line for r in info.references if r.name == name and r.kind == "default"}
            for ref in info.references:
                if ref.name != name:
                    continue
                where = f"{display_path(info.file)}:{ref.line}"
                if ref.kind == "set" and ref.line not in defaulted:
                    found.append(VariableRow(name, value=ref.value or "(expression)", where=where))
                elif ref.kind == "default":
                    found.append(
                        VariableRow(name, default=ref.value or "(expression)", where=where)
                    )
                elif ref.kind == "read":
                    reads.append(where)
        if not found:
            found.append(VariableRow(name, where="read at " + ", ".join(reads[:3])))
        rows.extend(dict.fromkeys(found))
    return rows


def _show(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()
