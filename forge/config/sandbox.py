"""The Jinja environment templates run in: sandboxed, with a documented set of names.

A template may come from anyone (a shared project, a pull request), so rendering one must
never run code or reach Python internals. Templates run in Jinja's
`ImmutableSandboxedEnvironment`; on top of it forge

- refuses every attribute or item named like `__dunder__` before a template runs, so a
  sandbox-escape attempt fails even in a branch that would not have run;
- turns every unsafe access the sandbox finds while rendering into an error at once
  (Jinja's default would only fail when the value is used);
- offers only the filters, tests and globals listed here (docs/templates.md: "What templates
  can use");
- bounds `*` and `**` so that `'x' * 10**10` or `2 ** 10**9` fails instead of eating the
  machine.
"""

from __future__ import annotations

import operator
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .analysis import TemplateInfo, analyze
from .functions import template_functions

# Jinja's filters that only compute a value; left out are `random` (a render must be
# reproducible) and the HTML ones (escape, safe, striptags, urlize, urlencode, xmlattr,
# filesizeformat, pprint, forceescape). `attr` stays: the sandbox checks the name it gets.
ALLOWED_FILTERS = (
    "abs attr batch capitalize center count d default dictsort first float format groupby "
    "indent int items join last length list lower map max min reject rejectattr replace "
    "reverse round select selectattr slice sort string sum title tojson trim truncate "
    "unique upper wordcount wordwrap"
).split()
# Jinja's tests, all pure predicates, except `escaped` (HTML markup).
ALLOWED_TESTS = (
    "!= < <= == > >= boolean callable defined divisibleby eq equalto even false filter "
    "float ge greaterthan gt in integer iterable le lessthan lower lt mapping ne none "
    "number odd sameas sequence string test true undefined upper"
).split()
# Of Jinja's globals only these; cycler, joiner, namespace and lipsum are gone.
ALLOWED_GLOBALS = {"range": range, "dict": dict}

MAX_SEQUENCE_PRODUCT = 10_000_000  # items (or characters) a `*` may produce
MAX_POWER_BITS = 100_000  # bits an integer `**` may produce


class UnsafeTemplateError(SecurityError):
    """A template reaches for Python internals; carries the template file and line."""

    def __init__(self, message: str, lineno: int | None = None, filename: str | None = None):
        super().__init__(message)
        self.lineno = lineno
        self.filename = filename


class RecordingContext(jinja2.runtime.Context):
    """A Jinja context that its environment keeps: one exists for each render of a template
    (the config, each include and import), and the blocks that ran are recorded per context."""

    def __init__(self, environment: jinja2.Environment, *args: Any, **kwargs: Any):
        super().__init__(environment, *args, **kwargs)
        contexts = getattr(environment, "contexts", None)
        if contexts is not None:
            contexts.append(self)


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """forge's sandboxed Jinja environment (see the module docstring).

    Besides rendering it observes the render: every block's text starts with a call that
    records (template, block) for the context it runs in, so that a block that never
    reached the output can be reported (`blocks_run`).
    """

    intercepted_binops = frozenset({"*", "**"})
    context_class = RecordingContext

    def __init__(self, **options: Any):
        super().__init__(**options)
        defaults_filters = self.filters
        self.filters = {name: defaults_filters[name] for name in ALLOWED_FILTERS}
        self.tests = {name: self.tests[name] for name in ALLOWED_TESTS}
        self.globals = dict(ALLOWED_GLOBALS)
        self.globals.update(template_functions())
        self.template_info: dict[str, TemplateInfo] = {}  # template name -> what it does
        self.contexts: list[jinja2.runtime.Context] = []  # kept alive: ids stay unique
        self._ran: dict[int, set[tuple[str, str]]] = {}  # id(context) -> (template, block)

    def record_block(self, context: jinja2.runtime.Context, template: str, block: str) -> str:
        """Called as a block's text starts (the call is put there by `_parse`)."""
        self._ran.setdefault(id(context), set()).add((template, block))
        return ""

    def blocks_run(self) -> list[tuple[str, set[tuple[str, str]]]]:
        """For each context of the renders so far: the template it rendered and the
        (template, block) pairs that ran in it."""
        return [(c.name or "", self._ran.get(id(c), set())) for c in self.contexts]

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        found = [
            (node.lineno, attr)
            for node in tree.find_all((nodes.Getattr, nodes.Getitem))
            if (attr := _dunder_name(node)) is not None
        ]
        if found:
            line = min(lineno for lineno, _ in found)
            # find_all goes from the outer node of `a.b.c` inwards: reversed is reading order
            names = dict.fromkeys(attr for lineno, attr in reversed(found) if lineno == line)
            listed = ", ".join(repr(n) for n in names)
            raise UnsafeTemplateError(
                f"unsafe template: {listed} reach{'es' if len(names) == 1 else ''} "
                "Python internals",
                line,
                filename,
            )
        if name is not None:
            self.template_info[name] = analyze(tree, name, filename or name, source)
            for block in tree.find_all(nodes.Block):
                block.body.insert(0, self._record_call(name, block))
        return tree

    def _record_call(self, template: str, block: nodes.Block) -> nodes.Node:
        """`record_block(context, template, block.name)` as a statement that outputs nothing."""
        call = nodes.Call(
            nodes.EnvironmentAttribute("record_block"),
            [nodes.ContextReference(), nodes.Const(template), nodes.Const(block.name)],
            [],
            None,
            None,
        )
        statement = nodes.ExprStmt(call)
        statement.set_lineno(block.lineno)
        statement.set_environment(self)
        return statement

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"unsafe template: access to attribute {attribute!r} of a "
            f"{type(obj).__name__!r} object is refused"
        )

    def call_binop(self, context: jinja2.runtime.Context, operator_: str, left, right) -> Any:
        if operator_ == "*":
            _check_product(left, right)
            return operator.mul(left, right)
        if operator_ == "**":
            _check_power(left, right)
            return operator.pow(left, right)
        return super().call_binop(context, operator_, left, right)


def _dunder_name(node: nodes.Node) -> str | None:
    if isinstance(node, nodes.Getattr):
        name = node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        name = node.arg.value
    else:
        return None
    return name if isinstance(name, str) and name.startswith("__") else None


def _check_product(left: Any, right: Any) -> None:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            if len(seq) * count > MAX_SEQUENCE_PRODUCT:
                raise SecurityError(
                    f"unsafe template: a {type(seq).__name__} repeated {count} times is "
                    f"larger than {MAX_SEQUENCE_PRODUCT} items"
                )


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if abs(base).bit_length() * exponent > MAX_POWER_BITS:
            raise SecurityError(
                f"unsafe template: {base} ** {exponent} is larger than {MAX_POWER_BITS} bits"
            )
