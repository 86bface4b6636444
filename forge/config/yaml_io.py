"""The YAML dialect forge reads and writes.

Safe loading only, with one change from PyYAML's YAML 1.1 defaults: floats written
without a dot (`1e-3`, `5E+4`) are floats, as in YAML 1.2 and as ML configs expect.
"""

from __future__ import annotations

import re

import yaml

_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class ForgeLoader(yaml.SafeLoader):
    """Safe loader with YAML 1.2 floats; forge tags are handled by the graph builder."""


class ForgeDumper(yaml.SafeDumper):
    """Safe dumper that agrees with `ForgeLoader` on which scalars need no tag.

    A scalar under a forge tag (`!singleton:math:sqrt 16`) stays plain where YAML allows,
    so that it reads back with the same type instead of as a quoted string.
    """

    def choose_scalar_style(self) -> str:
        style = super().choose_scalar_style()
        event = self.event
        tag = event.tag or ""
        if style != "'" or event.style or not tag.startswith("!") or tag.startswith("!!"):
            return style
        analysis = self.analysis
        plain_ok = analysis.allow_flow_plain if self.flow_level else analysis.allow_block_plain
        if event.value and plain_ok and not (self.simple_key_context and analysis.multiline):
            return ""
        return style


for _cls in (ForgeLoader, ForgeDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def parse_value(text: str) -> object:
    """`text` read as one YAML value (scalar or flow collection), with forge's floats."""
    return yaml.load(text, Loader=ForgeLoader)


def compose(text: str) -> yaml.Node | None:
    """The YAML node tree of `text` (aliases become shared nodes)."""
    return yaml.compose(text, Loader=ForgeLoader)


def serialize(node: yaml.Node) -> str:
    """YAML text for a node tree, keeping tags and turning shared nodes into anchors."""
    return yaml.serialize(node, Dumper=ForgeDumper, allow_unicode=True)


def describe_yaml_error(err: yaml.YAMLError, text: str) -> tuple[str, int | None]:
    """`invalid YAML: ...` for a PyYAML error in `text`, and its 1-based line if known."""
    if isinstance(err, yaml.reader.ReaderError):  # a character YAML does not allow
        character = err.character
        shown = f"#x{character:04x}" if isinstance(character, int) else repr(character)
        line = text.count("\n", 0, max(err.position, 0)) + 1
        return f"invalid YAML: character {shown} is not allowed ({err.reason})", line
    detail = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    message = f"invalid YAML: {detail}" + (f" ({context})" if context else "")
    mark = getattr(err, "problem_mark", None)
    return message, None if mark is None else mark.line + 1
