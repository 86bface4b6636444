"""A parsed config: its targets, check, build and a readable view of the graph."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from forge.suggest import suggestion

from .analysis import TemplateInfo, variables_read
from .build import CycleError, Materializer, missing_variables
from .callables import Resolver
from .check import check_graph, keywords_of
from .describe import describe_graph
from .errors import ConfigError, Problem, display_path, excerpt
from .graph import GraphConstructor, GraphProblem, Loc, VarNode, walk
from .overrides import apply_overrides
from .project import Project
from .render import RenderedConfig, SourceMap, render_config
from .resolved_view import resolved_yaml
from .yaml_io import compose, describe_yaml_error, serialize

logger = logging.getLogger(__name__)

_CONTEXT_LINES = 2


class Config:
    """Targets of one config and what can be done with them: check, build, describe."""

    def __init__(
        self,
        text: str,
        targets: dict[str, Any],
        *,
        rendered_text: str,
        source_map: SourceMap | None,
        origin: str,
        resolver: Resolver,
        graph_problems: list[GraphProblem],
        chain: list[tuple[str, str]] | None = None,
        project: Project | None = None,
        root: yaml.Node | None = None,
        override_origins: dict[int, str] | None = None,
        target_locs: dict[str, Loc] | None = None,
    ):
        self.text = text
        self.targets = targets
        self.chain = chain or []
        self.templates: dict[str, TemplateInfo] = {}  # what each rendered template does
        self.replaced_reads: set[str] = set()  # variables read only into replaced keys
        self.source_map = source_map
        self.origin = origin
        self.project = project
        self._rendered_lines = rendered_text.split("\n")
        self._resolver = resolver
        self._graph_problems = graph_problems
        self._checked: list[Problem] | None = None
        self._root = root
        self._override_origins = override_origins or {}
        self.target_locs = target_locs or {}

    @property
    def public_targets(self) -> list[str]:
        """Target names that do not start with '.', in file order."""
        return [name for name in self.targets if not name.startswith(".")]

    def check(self) -> list[Problem]:
        """Every problem in the graph, each located; never raises for user mistakes."""
        if self._checked is None:
            findings = [(p.loc, p.message, p.hint) for p in self._graph_problems]
            warnings: list = []
            findings += check_graph(list(self.targets.values()), self._resolver, warnings)
            self._checked = [self.problem(loc, message, hint) for loc, message, hint in findings]
            for loc, message, hint in warnings:
                logger.warning("%s", self.problem(loc, message, hint))
        return list(self._checked)

    def build(self, target: str | list[str], variables: Mapping[str, Any] | None = None) -> Any:
        """Fresh objects for one target (the object) or several (a dict name -> object).

        Objects are shared between the targets of one call (a singleton used by two
        targets is one object) and never between calls.
        """
        names = [target] if isinstance(target, str) else list(target)
        unknown = [n for n in names if n not in self.targets]
        if unknown:
            raise ConfigError(
                [
                    Problem(
                        f"no target {n!r}{suggestion(n, self.targets)}",
                        key_path=n,
                        hint="targets: " + ", ".join(self.public_targets),
                    )
                    for n in unknown
                ],
                config=self.origin,
            )
        problems = self.check()
        if problems:
            raise ConfigError(problems, config=self.origin)
        variables = dict(variables or {})
        values = [self.targets[n] for n in names]
        missing = missing_variables(values, variables)
        if missing:
            raise ConfigError(
                [
                    self.problem(
                        node.loc,
                        f"!var {node.var} has no value and no default",
                        f"pass it at build time, or write !var {{name: {node.var}, default: ...}}",
                    )
                    for node in missing
                ],
                config=self.origin,
            )
        materializer = Materializer(self._resolver.resolve, variables, self.describe_loc)
        try:
            built = {n: materializer.value(self.targets[n]) for n in names}
        except CycleError as err:
            raise ConfigError(self.problem(err.loc, str(err)), config=self.origin) from None
        return built[target] if isinstance(target, str) else built

    def variables_used(self) -> set[str]:
        """Names of every `!var` in the graph."""
        nodes = walk(list(self.targets.values()))
        return {n.var for n in nodes if isinstance(n, VarNode)}

    def resolved_text(self) -> str:
        """The YAML with each key once (its winning value) and a `# file:line` per key."""

        def locate(key: yaml.Node, value: yaml.Node) -> str | None:
            origin = self._override_origins.get(id(value))
            if origin:
                return origin
            mark = key.start_mark or value.start_mark
            return self.location_text(Loc("", mark.line + 1)) or None if mark else None

        return resolved_yaml(self._root, locate)

    def variables_read(self) -> set[str]:
        """Every template variable the render of this config read (empty if not rendered),
        less those read only into keys that a later key replaces."""
        return variables_read(self.templates, self.templates) - self.replaced_reads

    def describe_graph(self) -> str:
        """The node tree: each target, its nodes, what they resolve to, and where they came from."""
        return describe_graph(self.targets, self._resolver, self.location_text, self.target_locs)

    def problem(self, loc: Loc, message: str, hint: str | None = None) -> Problem:
        """A Problem for `loc`: template file and line, else the rendered line with context."""
        if loc.origin:
            return Problem(message, key_path=loc.key_path or None, hint=hint, context=loc.origin)
        file, line, context = self._where(loc.line)
        return Problem(message, file, line, loc.key_path or None, hint, context)

    def location_text(self, loc: Loc) -> str:
        """`templates/configs/train.yaml:12`, `rendered line 5`, `--set a=1`, or ''."""
        if loc.origin:
            return loc.origin
        file, line, _ = self._where(loc.line)
        if file is None:
            return "" if line is None else f"rendered line {line}"
        return f"{display_path(file)}:{line}"

    def variables_at(self, loc: Loc) -> list[str]:
        """The template variables that the template line which wrote ``loc`` reads (a `-D`
        there changes what it writes), in the order they are read; none for a `--set`."""
        if loc.origin:
            return []
        file, line, _ = self._where(loc.line)
        if file is None:
            return []
        names = [
            ref.name
            for info in self.templates.values()
            if info.file == file
            for ref in info.references
            if ref.line == line and ref.kind in ("read", "default")
        ]
        return list(dict.fromkeys(names))

    def describe_loc(self, loc: Loc) -> str:
        """`trainer.args (templates/configs/train.yaml:12)`, for notes on build errors."""
        location = self.location_text(loc)
        return f"{loc.key_path} ({location})" if location else loc.key_path

    def _where(self, line: int | None) -> tuple[str | None, int | None, str | None]:
        if line is None:
            return None, None, None
        if self.source_map is None:
            return self.origin, line, None
        found = self.source_map.get(line)
        if found is not None:
            return found[0], found[1], None
        return None, line, self._context(line)

    def _context(self, line: int) -> str:
        return excerpt(self._rendered_lines, line, _CONTEXT_LINES)


def parse_config(
    text: str,
    *,
    project: Project | None = None,
    source_map: SourceMap | None = None,
    overrides: Iterable[str] = (),
    allow: Iterable[str] = (),
    origin: str = "config.yaml",
) -> Config:
    """Parse rendered YAML into a Config, applying `--set` overrides first.

    Raises ConfigError for invalid YAML and for overrides that do not apply; problems
    in the graph itself are reported by `Config.check()`.
    """
    try:
        root = compose(text)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_problem(err, text, source_map, origin), config=origin) from None
    allowed = [*(project.allowed_modules if project else []), *allow]
    resolver = Resolver(
        project.root if project else None,
        allowed,
        project.meta_file if project else None,
        project.code_roots if project else (),
    )
    overrides = list(overrides)
    try:
        override_origins = (
            apply_overrides(root, overrides, lambda spec: keywords_of(resolver.resolve(spec)))
            if overrides
            else {}
        )
    except ConfigError as err:
        raise ConfigError(err.problems, config=origin) from None
    if overrides and root is not None:
        text_after = serialize(root)
    else:
        text_after = text
    constructor = GraphConstructor(override_origins)
    targets = constructor.targets(root)
    return Config(
        text_after,
        targets,
        rendered_text=text,
        source_map=source_map,
        origin=origin,
        resolver=resolver,
        graph_problems=constructor.problems,
        project=project,
        root=root,
        override_origins=override_origins,
        target_locs=constructor.target_locs,
    )


def load_config(
    project: Project,
    config: str,
    variables: Mapping[str, Any] | None = None,
    overrides: Iterable[str] = (),
    allow: Iterable[str] = (),
    *,
    check_variables: bool = True,
) -> Config:
    """Render a project's config, parse it and apply `--set` overrides.

    With `check_variables`, a variable in `variables` that no template reads is an error.
    """
    rendered: RenderedConfig = render_config(
        project, config, variables, check_variables=check_variables
    )
    parsed = parse_config(
        rendered.text,
        project=project,
        source_map=rendered.source_map,
        overrides=overrides,
        allow=allow,
        origin=rendered.config,
    )
    parsed.chain = rendered.chain
    parsed.templates = rendered.templates
    parsed.replaced_reads = rendered.replaced_reads
    return parsed


def _yaml_problem(
    err: yaml.YAMLError, text: str, source_map: SourceMap | None, origin: str
) -> Problem:
    message, line = describe_yaml_error(err, text)
    if line is None:
        return Problem(message, file=origin)
    if source_map is None:
        return Problem(message, file=origin, line=line)
    found = source_map.get(line)
    context = excerpt(text.split("\n"), line, _CONTEXT_LINES)
    if found is not None:
        return Problem(message, file=found[0], line=found[1], context="rendered:\n" + context)
    return Problem(message, line=line, context=context)
