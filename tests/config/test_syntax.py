"""forge's line syntax: every row of the table in DESIGN.md."""

from __future__ import annotations

import pytest

from forge.config import render_config
from forge.config.syntax import MARK_CLOSE, MARK_OPEN, strip_trailing_comment


def render(config_project, text: str, **variables) -> str:
    return render_config(config_project(text), "train", variables).text


def test_statement_line(config_project):
    text = """\
    -- set width = 4
    -- if width > 2
    width: {{ width }}
    -- endif
    """
    assert render(config_project, text) == "width: 4\n"


def test_statement_line_keeps_indentation_free_of_blank_lines(config_project):
    text = """\
    model:
      -- for i in range(2)
      layer{{ i }}: {{ i }}
      -- endfor
    """
    assert render(config_project, text) == "model:\n  layer0: 0\n  layer1: 1\n"


def test_trim_before(config_project):
    # `<<` is `{%- ... %}`: the newline of the line above disappears.
    text = """\
    a: 1
    b: x
    << if true
    y
    -- endif
    """
    assert render(config_project, text) == "a: 1\nb: xy\n"


def test_trim_after(config_project):
    # `>>` is `{% ... -%}`: whitespace after the tag, up to the next text, disappears.
    text = """\
    >> if true

        a: 1
    -- endif
    """
    assert render(config_project, text) == "a: 1\n"


def test_expression_line_goes_to_column_zero(config_project):
    text = """\
    -- set block = "  k: 1\\n  j: 2\\n"
    outer:
        == block
    """
    assert render(config_project, text) == "outer:\n  k: 1\n  j: 2\n\n"


def test_trimmed_expression_line_strips_outer_newlines(config_project):
    text = """\
    -- set block = "\\n\\n  k: 1\\n  j: 2\\n\\n"
    outer:
        => block
    after: 3
    """
    assert render(config_project, text) == "outer:\n  k: 1\n  j: 2\nafter: 3\n"


def test_full_line_comment_leaves_no_blank_line(config_project):
    text = """\
    ## a comment
    a: 1
        ## indented comment
    b: 2
    """
    assert render(config_project, text) == "a: 1\nb: 2\n"


def test_trailing_comment_removed_outside_quotes(config_project):
    text = """\
    a: 1 ## gone
    b: "keep ## this" ## but not this
    c: 'it''s ## kept' ## dropped
    d: don't ## drop
    e: http://host/x##y
    """
    assert render(config_project, text) == (
        "a: 1\nb: \"keep ## this\"\nc: 'it''s ## kept'\nd: don't\ne: http://host/x##y\n"
    )


def test_trailing_comment_on_statement_line(config_project):
    text = """\
    -- set n = 2 ## two
    n: {{ n }}
    """
    assert render(config_project, text) == "n: 2\n"


def test_yaml_comments_and_plain_dashes_pass_through(config_project):
    text = """\
    # a YAML comment
    items:
      - a
      - --b
    """
    assert render(config_project, text) == "# a YAML comment\nitems:\n  - a\n  - --b\n"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("a: 1 ## x", "a: 1"),
        ("a: '##' ## x", "a: '##'"),
        ('a: "\\" ##" ## x', 'a: "\\" ##"'),
        ("a: [x, 'y ## z'] ## x", "a: [x, 'y ## z']"),
        ("a: b##c", "a: b##c"),
        ("a: 1", "a: 1"),
    ],
)
def test_strip_trailing_comment(line, expected):
    assert strip_trailing_comment(line) == expected


def test_rendered_text_has_no_markers(config_project):
    text = """\
    -- macro item(n)
    i{{ n }}: {{ n }}
    -- endmacro
    -- for n in range(3)
    == item(n)
    -- endfor
    """
    out = render(config_project, text)
    assert MARK_OPEN not in out and MARK_CLOSE not in out
    assert [line for line in out.splitlines() if line] == ["i0: 0", "i1: 1", "i2: 2"]


def test_inline_block_tag_keeps_its_line(config_project):
    text = """\
    dtype: {% if half %}float16{% else %}float32{% endif %}
    next: 1
    """
    assert render(config_project, text, half=True) == "dtype: float16\nnext: 1\n"


def test_whitespace_control_is_respected(config_project):
    text = """\
    a: {{ "x" -}}
       y
    """
    assert render(config_project, text) == "a: xy\n"


SECTIONED_BASE = """\
top: 1
[model]
model: small
[trainer]
trainer:
  steps: 10
"""


def test_section_lines_open_blocks_a_child_overrides(make_project):
    project = make_project(
        {
            "templates/base.yaml": SECTIONED_BASE,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n[trainer]\n== super()\n  lr: 0.1 ## section text\n"
            ),
        }
    )
    rendered = render_config(project, "train")
    assert [line for line in rendered.text.splitlines() if line] == [
        "top: 1",
        "model: small",
        "trainer:",
        "  steps: 10",
        "  lr: 0.1",
    ]
    config_file = str(project.configs_dir / "train.yaml")
    lines = rendered.text.split("\n")
    assert rendered.source_map[lines.index("  lr: 0.1") + 1] == (config_file, 4)


def test_section_runs_to_the_end_of_its_inline_template(make_project):
    project = make_project(
        {
            "templates/base.yaml": SECTIONED_BASE,
            "templates/configs/train.yaml": (
                "a: 0\n-- include 'sub'\n#---- sub ----\n-- extends 'base.yaml'\n"
                "    [model]\nmodel: big\n"
            ),
        }
    )
    text = render_config(project, "train").text
    assert text == "a: 0\ntop: 1\nmodel: big\ntrainer:\n  steps: 10\n"


@pytest.mark.parametrize("line", ["[1, 2]", "[a, b]", "x: [a]", "[a] b", "[a-b]"])
def test_other_bracket_lines_stay_yaml(config_project, line):
    assert render(config_project, f"k:\n  {line}\n") == f"k:\n  {line}\n"


def test_section_with_a_typo_is_reported_like_a_block(make_project):
    from forge.config import ConfigError

    project = make_project(
        {
            "templates/base.yaml": SECTIONED_BASE,
            "templates/configs/train.yaml": "-- extends 'base.yaml'\n[trainr]\nx: 1\n",
        }
    )
    with pytest.raises(ConfigError, match="block 'trainr' is not defined.*did you mean 'trainer'"):
        render_config(project, "train")
