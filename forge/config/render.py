"""Rendering a config: Jinja over forge's line syntax, along the project's search path.

Render is pure: it reads templates and produces YAML text, never importing user code.
"""

from __future__ import annotations

import json
import logging
import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml
from jinja2.sandbox import SecurityError

from forge.suggest import offer, suggestion

from .analysis import (
    TemplateInfo,
    check_inheritance,
    unrendered_blocks,
    unused_variables,
    variables_read,
)
from .errors import ConfigError, Problem, display_path
from .project import Project
from .replaced import ReplacedRead, replaced_reads
from .sandbox import TemplateEnvironment, UnsafeTemplateError
from .syntax import (
    STRIP_NEWLINES_FILTER,
    split_templates,
    strip_markers,
    strip_newlines,
    translate,
)
from .yaml_io import compose, parse_value

logger = logging.getLogger(__name__)

SourceMap = dict[int, "tuple[str, int] | None"]
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNDEFINED_RE = re.compile(r"^'([A-Za-z_][A-Za-z0-9_]*)' is undefined$")


@dataclass
class RenderedConfig:
    """YAML text of a config, the templates it came from, and where each line came from."""

    text: str
    chain: list[tuple[str, str]] = field(default_factory=list)
    source_map: SourceMap = field(default_factory=dict)
    config: str = ""
    templates: dict[str, TemplateInfo] = field(default_factory=dict)  # the chain's, by name
    # variables read only into keys that a later key replaces (see replaced.py)
    replaced_reads: set[str] = field(default_factory=set)

    def locate(self, line: int) -> tuple[str, int] | None:
        """(template file, line) that rendered line `line` (1-based) came from."""
        return self.source_map.get(line)


class TemplateLoader(jinja2.BaseLoader):
    """Finds templates along the search path and registers inline sub-templates."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self.inline: dict[str, tuple[str, str]] = {}  # name -> (Jinja source, file)
        self.files: list[str] = []  # file id (as used in markers) -> path
        self.chain: list[tuple[str, str]] = []
        self.token = secrets.token_hex(8)  # signs this render's provenance markers

    def get_source(
        self, environment: jinja2.Environment, template: str
    ) -> tuple[str, str, Callable[[], bool]]:
        if template in self.inline:
            source, filename = self.inline[template]
        else:
            path = self.find(template)
            if path is None:
                raise jinja2.TemplateNotFound(template)
            source, filename = self._load_file(template, path), str(path)
        if (template, filename) not in self.chain:
            self.chain.append((template, filename))
        return source, filename, lambda: True

    def find(self, name: str) -> Path | None:
        parts = name.replace("\\", "/").split("/")
        if any(p in ("", ".", "..") for p in parts):
            return None
        for root in self.roots:
            path = root.joinpath(*parts)
            if path.is_file():
                real = path.resolve()
                if not real.is_relative_to(root.resolve()):
                    raise SecurityError(
                        f"unsafe template: {name!r} is a link to {real}, outside the template "
                        f"directory {display_path(root)}; add its directory to search_paths "
                        "in meta.yaml to use it"
                    )
                return path
        return None

    def _load_file(self, name: str, path: Path) -> str:
        file_id = len(self.files)
        self.files.append(str(path))
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            line = path.read_bytes()[: err.start].count(b"\n") + 1
            message = f"not UTF-8 text: {err.reason} at byte {err.start}"
            raise jinja2.TemplateSyntaxError(message, line, name, str(path)) from None
        parts = split_templates(source, name)
        for part in parts[1:]:
            if part.name in self.inline:
                logger.warning(
                    "%s:%d: inline template %r is already defined in %s; keeping that one",
                    display_path(path),
                    part.first_line - 1,
                    part.name,
                    display_path(self.inline[part.name][1]),
                )
                continue
            self.inline[part.name] = (translate(part, file_id, self.token), str(path))
        return translate(parts[0], file_id, self.token)

    def available(self) -> list[str]:
        """Every template name the search path and the inline templates offer."""
        names = set(self.inline)
        for root in self.roots:
            if root.is_dir():
                for p in root.rglob("*"):
                    if p.is_file() and not any(s.startswith(".") for s in p.parts[-2:]):
                        names.add(p.relative_to(root).as_posix())
        return sorted(names)


def builtin_variables(project: Project, config: str) -> dict[str, Any]:
    """Variables every template sees."""
    return {
        "project_dir": str(project.root),
        "project_name": project.name,
        "config_name": config.rsplit(".", 1)[0],
        "output_root": str(project.output_dir),
    }


def render_config(
    project: Project,
    config: str,
    variables: Mapping[str, Any] | None = None,
    *,
    check_variables: bool = True,
) -> RenderedConfig:
    """Render `templates/configs/<config>` of `project` to YAML text.

    Raises ConfigError for what Jinja would pass silently: a block no parent defines, a
    key less indented than the block it fills, and (with `check_variables`) a variable
    in `variables` that no template reads.
    """
    name = project.resolve_config_name(config)
    loader = TemplateLoader(project.template_roots)
    env = TemplateEnvironment(
        loader=loader,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        finalize=yaml_text,
    )
    env.filters[STRIP_NEWLINES_FILTER] = strip_newlines
    # Globals reach every template: parents, includes and imports alike.
    env.globals.update(builtin_variables(project, name))
    env.globals.update(variables or {})
    try:
        output = env.get_template(f"configs/{name}").render()
        _parse_unused_inline(env, loader)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(_syntax_problem(err, loader), config=name) from None
    except SecurityError as err:
        raise ConfigError(_unsafe_problem(err, loader), config=name) from None
    except jinja2.TemplateNotFound as err:
        raise ConfigError(_not_found_problem(err, loader), config=name) from None
    except Exception as err:  # any error raised while a template runs
        raise ConfigError(_runtime_problem(err, loader), config=name) from None
    used = [template for template, _ in loader.chain]
    problems = check_inheritance(env.template_info, used)
    unrendered, unrendered_warnings = unrendered_blocks(env.template_info, env.blocks_run())
    problems += [p for p in unrendered if p not in problems]
    for warning in unrendered_warnings:
        logger.warning("%s", warning)
    text, origins = strip_markers(output, loader.token)
    source_map: SourceMap = {
        number: (loader.files[o[0]], o[1]) if o else None
        for number, o in enumerate(origins, start=1)
    }
    infos = {t: env.template_info[t] for t in used if t in env.template_info}
    replaced = replaced_reads(infos, source_map, text)
    if check_variables:
        read = variables_read(env.template_info, used) - set(replaced)
        unread = [v for v in variables or {} if v not in replaced]
        problems += unused_variables(unread, read)
        problems += [
            _replaced_problem(var, replaced[var], source_map)
            for var in variables or {}
            if var in replaced
        ]
    if problems:
        raise ConfigError(problems, config=name)
    logger.debug("rendered %s from %d templates", name, len(loader.chain))
    return RenderedConfig(
        text=text,
        chain=list(loader.chain),
        source_map=source_map,
        config=name,
        templates=infos,
        replaced_reads=set(replaced),
    )


def _replaced_problem(var: str, reads: list[ReplacedRead], source_map: SourceMap) -> Problem:
    def where(line: int) -> str:
        origin = source_map.get(line)
        return f"{display_path(origin[0])}:{origin[1]}" if origin else f"rendered line {line}"

    shown = "; ".join(
        f"{display_path(r.file)}:{r.line} by {where(r.replaced_by)}" for r in reads[:3]
    )
    last = source_map.get(reads[0].replaced_by)
    return Problem(
        f"-D {var}: every line that reads {var!r} writes a key that a later key replaces "
        f"({shown}), so it would change nothing",
        file=last[0] if last else None,
        line=last[1] if last else None,
        hint=f"write that key as {{{{ {var} | default(...) }}}} to let -D {var} set it, "
        "or leave out the -D",
    )


def _parse_unused_inline(env: jinja2.Environment, loader: TemplateLoader) -> None:
    """Report syntax errors in inline templates that this render did not use."""
    used = {name for name, _ in loader.chain}
    for name, (source, filename) in loader.inline.items():
        if name not in used:
            env.parse(source, name, filename)


def yaml_text(value: Any) -> Any:
    """What ``{{ value }}`` writes (Jinja's ``finalize``): a value that Python prints otherwise
    than YAML reads it is written as YAML: None as ``null`` (Python's ``None`` is the string
    'None' in YAML), lists and mappings as flow YAML (their strings quoted, their nulls null,
    their booleans true/false), so ``-D v=null`` or ``-D v=[a, null]`` renders to the value
    the ``-D`` was read as. Anything else is written as Python prints it: a string as it is (a
    template quotes it where YAML needs that, e.g. with ``| tojson``), a number, a boolean
    (``True``, which YAML reads as true)."""
    if value is None or isinstance(value, list | tuple | dict):
        return _flow_yaml(value)
    return value


def _flow_yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        return repr(value) if math.isfinite(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_flow_yaml(item) for item in value) + "]"
    if isinstance(value, dict):
        pairs = (f"{_flow_yaml(k)}: {_flow_yaml(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # a string: quoted, as JSON (YAML) does


def parse_define(text: str) -> tuple[str, Any]:
    """`-D name=value`: the name and the value read as YAML (`20` is an int, `abc` a str)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not _NAME_RE.match(name):
        raise ConfigError(
            Problem(
                f"bad variable definition {text!r}: expected NAME=VALUE",
                hint="NAME is a template variable name, e.g. -D max_steps=20",
            )
        )
    if not raw.strip():
        return name, ""
    try:
        node = compose(raw)
        if isinstance(node, yaml.CollectionNode) and not node.flow_style:
            return name, raw  # block YAML such as "a: b" is text, not a mapping
        return name, parse_value(raw)
    except yaml.YAMLError:
        return name, raw  # not a YAML value: keep the text as given


def _syntax_problem(err: jinja2.TemplateSyntaxError, loader: TemplateLoader) -> Problem:
    if err.filename is None and err.name in loader.files:
        err.filename = err.name  # Jinja's lexer passes the file as the name for some errors
    context = _source_line(err.filename, err.lineno)
    where = f" (in template {err.name!r})" if err.name and err.name != err.filename else ""
    return Problem(
        f"template syntax error: {err.message}{where}",
        file=err.filename,
        line=err.lineno,
        context=context,
    )


def _not_found_problem(err: jinja2.TemplateNotFound, loader: TemplateLoader) -> Problem:
    file, line = _template_frame(err, loader)
    names = getattr(err, "templates", None) or [err.name]
    available = loader.available()
    hints = []
    for name in names:
        base = str(name).rsplit("/", 1)[-1]
        same_base = [a for a in available if a.rsplit("/", 1)[-1] == base]
        close = suggestion(str(name), available)
        if same_base:
            hints.append(offer(same_base))
        elif close:
            hints.append(close.lstrip("; "))
    roots = ", ".join(display_path(r) for r in loader.roots)
    return Problem(
        f"template {' or '.join(repr(str(n)) for n in names)} not found (searched: {roots})",
        file=file,
        line=line,
        hint=" ".join(hints) or None,
    )


def _unsafe_problem(err: SecurityError, loader: TemplateLoader) -> Problem:
    if isinstance(err, UnsafeTemplateError) and err.filename:
        file, line = err.filename, err.lineno
    else:
        file, line = _template_frame(err, loader)
    message = str(err)
    if not message.startswith("unsafe template"):
        message = f"unsafe template: {message}"
    return Problem(
        message,
        file=file,
        line=line,
        context=_source_line(file, line),
        hint="templates run sandboxed and cannot reach Python internals or call code; "
        "build such values with a !call in the YAML instead",
    )


def _source_line(file: str | None, line: int | None) -> str | None:
    if not file or not line:
        return None
    try:
        text = Path(file).read_text(encoding="utf-8", errors="replace")
        return f"{line} | {text.split(chr(10))[line - 1]}"
    except (OSError, IndexError):
        return None


def _runtime_problem(err: Exception, loader: TemplateLoader) -> Problem:
    file, line = _template_frame(err, loader)
    if isinstance(err, jinja2.TemplateError):
        message = err.message or type(err).__name__
    else:
        message = f"{type(err).__name__}: {err}"
    hint = None
    match = _UNDEFINED_RE.match(message)
    if match:
        hint = f"define it with -D {match.group(1)}=VALUE or set it in the template"
    return Problem(message, file=file, line=line, hint=hint)


def _template_frame(err: BaseException, loader: TemplateLoader) -> tuple[str | None, int | None]:
    """(file, line) of the innermost template frame in the traceback Jinja rewrote."""
    known = set(loader.files)
    found: tuple[str | None, int | None] = (None, None)
    tb = err.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename in known:
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found
