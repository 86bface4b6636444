"""Fuzzing: malformed templates, YAML, -D / --set values and meta.yaml files always end
with exit 2 and a located message (or succeed), never with a traceback.

Each example runs the real command line in-process (`forge.cli.main`). The default suite
runs a few derandomized examples per target; `-m slow` runs many random ones.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge.cli import main
from forge.config.syntax import MARK_CLOSE, MARK_OPEN

FAST = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SLOW = settings(
    max_examples=600,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# A problem names where it is: a template line, the rendered line, meta.yaml or the flag.
LOCATED = re.compile(r"\.ya?ml:\d+|rendered line \d+|meta\.yaml|-D |--set |\(in --set ")

BASE = """\
top: 1
-- block body
body:
    x: {{ x | default(1) }}
-- endblock
"""

FRAGMENTS = [
    "-- ",
    "== ",
    "=> ",
    "<< ",
    ">> ",
    "## ",
    "#---- sub ----",
    "[body]",
    "[other]",
    "{{",
    "}}",
    "{%",
    "%}",
    "{#",
    "#}",
    "{{ x }}",
    "{{ super() }}",
    "{{ y.z }}",
    "block body",
    "endblock",
    "extends 'base.yaml'",
    "extends 'nope.yaml'",
    "include 'sub'",
    "include 'base.yaml'",
    "set x = 2",
    "if x",
    "endif",
    "for i in range(3)",
    "endfor",
    "macro m()",
    "endmacro",
    "import 'base.yaml' as b",
    "raw",
    "endraw",
    "x | default(",
    "key:",
    "  ",
    "    ",
    "\t",
    "- ",
    "!call:math:sqrt",
    "!call:./helpers.py:Thing",
    "!singleton:",
    "!var x",
    "!var {name: y}",
    "!list",
    "!tuple",
    "!dict",
    "!nope:a:b",
    "&a",
    "*a",
    "*missing",
    "<<: *a",
    "[",
    "]",
    "{",
    "}",
    "'",
    '"',
    ":",
    ",",
    "?",
    "|",
    ">",
    "_args:",
    "size: 1",
    "0x",
    "1e3",
    "null",
    "~",
    "é",
    "\u2028",
    "\x00",
    MARK_OPEN,
    MARK_CLOSE,
    f"{MARK_OPEN}7.3{MARK_CLOSE}",
    f"{MARK_OPEN}0.999{MARK_CLOSE}",
    "__class__",
    "cycler",
    "lipsum",
    "'a' * 9",
    "2 ** 99",
]

noise = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=5).map(
    "".join
)
KEYS = ["top", "body", "x", ".h", "t", "_args", "<<", "size", "name", "a b", "'q'"]
VALUES = [
    "1",
    "",
    "{{ x }}",
    "{{ x | default(3) }}",
    "!call:./helpers.py:Thing",
    "!call:math:sqrt 4",
    "!call:./helpers.py:Thing {size: 1}",
    "!call:./helpers.py:Thing [1, 2, 3]",
    "*a",
    "&a 1",
    "&a !dict",
    "!var x",
    "!var {name: x, default: 1}",
    "!list [1]",
    "!tuple",
    "[1, {a: 2}]",
    "{{ super() }}",
    "!factory:./helpers.py:Thing {sise: 1}",
    "!partial:math:pow [2]",
    "!call:os:system [x]",
    "'{{ y }}'",
    "!call:./../x.py:f",
    '"a\\x"',
    "~",
]
STATEMENTS = [
    "extends 'base.yaml'",
    "block body",
    "block bdy",
    "endblock",
    "set x = 4",
    "if x",
    "else",
    "endif",
    "for i in range(2)",
    "endfor",
    "include 'sub'",
    "macro m(a)",
    "endmacro",
    "set y = x | default(2)",
    "import 'base.yaml' as b",
    "extends x",
]
structured = st.one_of(
    st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)).map(lambda kv: f"{kv[0]}: {kv[1]}"),
    st.sampled_from(STATEMENTS).map("-- ".__add__),
    st.sampled_from(["super()", "x", "m(1)", "b.m", "x * 2"]).map("== ".__add__),
    st.sampled_from(["[body]", "[bdy]", "#---- sub ----", "## note", "- 1", "- *a"]),
)
line = st.tuples(
    st.sampled_from(["", "", "  ", "    ", "\t"]),
    st.one_of(structured, structured, structured, noise),
).map("".join)
template = st.lists(line, max_size=12).map("\n".join)
yaml_text = st.lists(
    st.lists(
        st.one_of(st.sampled_from([f for f in FRAGMENTS if "{" not in f]), st.text(max_size=4)),
        max_size=5,
    ).map("".join),
    max_size=8,
).map("\n".join)
flag_value = st.one_of(
    st.text(max_size=12), st.lists(st.sampled_from(FRAGMENTS), max_size=4).map("".join)
)
key_path = st.lists(
    st.sampled_from(["top", "body", "x", ".h", "0", "", "size", "nope", "a b"]), max_size=4
).map(".".join)

HELPERS = "class Thing:\n    def __init__(self, size, name='x'):\n        self.size = size\n"


def run_cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exit_:  # argparse refusing a flag value
            code = exit_.code
    return code, err.getvalue()


def assert_clean(code: int, stderr: str) -> None:
    assert code in (0, 2), (code, stderr)
    assert "Traceback" not in stderr and "(run again with -v" not in stderr, stderr
    if code == 2 and not stderr.startswith("usage:"):
        assert LOCATED.search(stderr), stderr


def make_project(root: Path, config: str | bytes, meta: str | bytes = "name: fuzz\n") -> Path:
    (root / "templates" / "configs").mkdir(parents=True)
    (root / "helpers.py").write_text(HELPERS)
    (root / "templates" / "base.yaml").write_text(BASE)
    for path, text in ((root / "meta.yaml", meta), (root / "templates/configs/train.yaml", config)):
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return root


def check_template(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(Path(tmp), text)
        assert_clean(*run_cli(["render", "train", "-p", str(root)]))
        assert_clean(*run_cli(["ls", "-p", str(root)]))


def check_yaml(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(Path(tmp), "{% raw %}" + text + "{% endraw %}")
        assert_clean(*run_cli(["ls", "-p", str(root)]))


def check_flags(define: str, override: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(
            Path(tmp), "-- extends 'base.yaml'\nt: !call:./helpers.py:Thing {size: 1}\n"
        )
        args = ["render", "train", "-p", str(root), "--graph"]
        assert_clean(*run_cli([*args, "-D", define]))
        assert_clean(*run_cli([*args, "--set", override]))


def check_meta(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(Path(tmp), "a: 1\n", meta=text)
        assert_clean(*run_cli(["ls", "-p", str(root)]))


@FAST
@given(st.one_of(template, template.map(lambda t: t.encode("utf-8") + b"\n\xff\xfe: 1")))
def test_malformed_templates(text):
    check_template(text)


@FAST
@given(yaml_text)
def test_malformed_yaml(text):
    check_yaml(text)


@FAST
@given(
    st.tuples(st.sampled_from(["x", "y", "x_", "1x", ""]), flag_value).map("=".join),
    st.tuples(key_path, flag_value).map("=".join),
)
def test_malformed_flag_values(define, override):
    check_flags(define, override)


meta_text = st.one_of(
    yaml_text,
    yaml_text.map(lambda t: b"name: x\n" + t.encode("utf-8") + b"\xc3"),
    st.dictionaries(
        st.sampled_from(
            [
                "name",
                "description",
                "default_config",
                "search_paths",
                "code_paths",
                "allowed_modules",
                "nmae",
                "1",
            ]
        ),
        st.one_of(
            st.none(), st.integers(), st.text(max_size=6), st.lists(st.text(max_size=6), max_size=3)
        ),
        max_size=4,
    ).map(lambda d: "\n".join(f"{k}: {v!r}" for k, v in d.items())),
)


@FAST
@given(meta_text)
def test_malformed_meta_yaml(text):
    check_meta(text)


@pytest.mark.slow
@SLOW
@given(template)
def test_malformed_templates_many(text):
    check_template(text)


@pytest.mark.slow
@SLOW
@given(yaml_text)
def test_malformed_yaml_many(text):
    check_yaml(text)


@pytest.mark.slow
@SLOW
@given(
    st.tuples(st.sampled_from(["x", "y", "x_", "1x", ""]), flag_value).map("=".join),
    st.tuples(key_path, flag_value).map("=".join),
)
def test_malformed_flag_values_many(define, override):
    check_flags(define, override)


@pytest.mark.slow
@SLOW
@given(meta_text)
def test_malformed_meta_yaml_many(text):
    check_meta(text)
