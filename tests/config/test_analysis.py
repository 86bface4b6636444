"""What Jinja would pass silently is reported, located: unread -D variables, blocks no
parent defines, keys less indented than the block they fill."""

from __future__ import annotations

import pytest

from forge.config import ConfigError, render_config
from tests.helpers import TINY_LM, run_forge

PARENT = """\
top: 1
args:
-- block args
    lr: {{ lr | default(0.1) }}
    steps: 10
-- endblock
-- block extra
-- endblock
"""


def render_problems(project, config="train", variables=None):
    with pytest.raises(ConfigError) as info:
        render_config(project, config, variables)
    return info.value.problems


def test_unread_define_is_an_error_with_suggestion(make_project):
    project = make_project(
        {"templates/base.yaml": PARENT, "templates/configs/train.yaml": "-- extends 'base.yaml'\n"}
    )
    (problem,) = render_problems(project, variables={"lr": 1, "l_r": 2})
    assert problem.message.startswith("-D l_r: no template of this config reads")
    assert "did you mean 'lr'?" in problem.message
    assert "lr: 1" in render_config(project, "train", {"lr": 1}).text


def test_unread_define_through_the_cli():
    result = run_forge("render", "-p", str(TINY_LM), "-D", "max_step=5")
    assert result.returncode == 2
    assert "-D max_step: no template of this config reads a variable 'max_step'" in result.stderr
    assert "did you mean 'max_steps'" in result.stderr
    assert result.stdout == ""


def test_define_read_only_by_a_parent_or_include_is_used(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/part.yaml": "part: {{ part_value }}\n",
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block extra\n-- include 'part.yaml'\n-- endblock\n"
            ),
        }
    )
    text = render_config(project, "train", {"lr": 5, "part_value": 6}).text
    assert "lr: 5" in text and "part: 6" in text


def test_block_no_parent_defines_is_located(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block extr\nx: 1\n-- endblock\n"
            ),
        }
    )
    (problem,) = render_problems(project)
    assert (problem.file, problem.line) == (str(project.configs_dir / "train.yaml"), 2)
    assert "block 'extr' is not defined in any parent template ('base.yaml')" in problem.message
    assert "did you mean 'extra'?" in problem.message


def test_nested_new_block_inside_a_known_block_is_fine(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block extra\n-- block inner\nx: 1\n-- endblock\n"
                "-- endblock\n"
            ),
        }
    )
    assert "x: 1" in render_config(project, "train").text


def test_unknown_block_in_an_inline_template_of_an_include(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "a: 1\n-- include 'sub'\n#---- sub ----\n-- extends 'base.yaml'\n"
                "-- block arg\n    lr: 2\n-- endblock\n"
            ),
        }
    )
    (problem,) = render_problems(project)
    assert problem.line == 5 and "block 'arg'" in problem.message


@pytest.mark.parametrize("with_super", [True, False])
def test_key_at_column_zero_in_an_indented_block_is_located(make_project, with_super):
    sup = "    == super()\n" if with_super else ""
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                f"-- extends 'base.yaml'\n-- block args\n{sup}steps: 20\n-- endblock\n"
            ),
        }
    )
    (problem,) = render_problems(project)
    assert problem.file == str(project.configs_dir / "train.yaml")
    assert problem.line == (4 if with_super else 3)
    assert "key 'steps' is written at column 0 inside block 'args'" in problem.message
    assert "indented by 4" in problem.message
    assert problem.hint.startswith("indent it by 4 spaces")


def test_key_at_column_zero_is_found_through_a_parent_that_starts_its_block_with_super(
    make_project,
):
    """The parent's own override begins with `== super()` (written at column 0, its value
    carrying its own indentation): the block's indentation is that of its keys, not 0."""
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n    steps: 20\n-- endblock\n"
            ),
            "templates/configs/child.yaml": (
                "-- extends 'configs/train.yaml'\n-- block args\n    == super()\nsteps: 5\n"
                "-- endblock\n"
            ),
        }
    )
    (problem,) = render_problems(project, "child")
    assert problem.file == str(project.configs_dir / "child.yaml") and problem.line == 4
    assert "key 'steps' is written at column 0 inside block 'args'" in problem.message
    assert "whose text in 'configs/train.yaml' is indented by 4" in problem.message


def test_text_outside_blocks_is_told_the_indentation_of_a_parent_that_starts_with_super(
    make_project,
):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n    steps: 20\n-- endblock\n"
            ),
            "templates/configs/child.yaml": "-- extends 'configs/train.yaml'\nsteps: 5\n",
        }
    )
    (problem,) = render_problems(project, "child")
    assert problem.message.startswith("text outside any block")
    assert "the line indented by 4" in problem.hint


def test_indented_override_is_fine(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n    steps: 20\n-- endblock\n"
            ),
        }
    )
    lines = render_config(project, "train").text.splitlines()
    assert lines[-1] == "    steps: 20"


def test_problems_are_reported_together(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\nsteps: 20\n-- endblock\n"
                "-- block nope\n-- endblock\n"
            ),
        }
    )
    problems = render_problems(project, variables={"zzz": 1})
    assert [p.line for p in problems] == [3, 5, None]


# A parent that places block `args` inside block `trainer`, and a middle template that fills
# `trainer` with an include, as the scaffolds did: `args` of a child of the middle one is cut off.
NESTING = """\
-- block trainer
trainer:
    -- block args
    lr: 0.1
    -- endblock
-- endblock
"""
MIDDLE = """\
-- extends 'base.yaml'
-- block trainer
    -- include 'mid.trainer'
-- endblock
#---- mid.trainer ----
-- extends 'base.yaml'
-- block args
    == super()
    steps: 300
-- endblock
"""


def test_block_cut_off_by_a_parent_that_replaced_the_block_around_it(make_project):
    project = make_project(
        {
            "templates/base.yaml": NESTING,
            "templates/configs/mid.yaml": MIDDLE,
            "templates/configs/child.yaml": (
                "-- extends 'configs/mid.yaml'\n-- block args\n    == super()\n    steps: 77\n"
                "-- endblock\n"
            ),
        }
    )
    assert "steps: 300" in render_config(project, "mid").text  # the middle one alone is fine
    (problem,) = render_problems(project, "child")
    assert (problem.file, problem.line) == (str(project.configs_dir / "child.yaml"), 2)
    assert "block 'args' never reaches the output" in problem.message
    assert "'configs/mid.yaml' replaces block 'trainer'" in problem.message
    assert "mid.yaml:2" in problem.message
    assert "'mid.trainer'" in problem.hint


def test_block_cut_off_by_its_own_template(make_project):
    project = make_project(
        {
            "templates/base.yaml": NESTING,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block trainer\ntrainer: {}\n-- endblock\n"
                "-- block args\n    lr: 2\n-- endblock\n"
            ),
        }
    )
    (problem,) = render_problems(project)
    assert problem.line == 5 and "block 'args' never reaches the output" in problem.message


def test_replacing_the_block_around_a_parents_block_is_fine(make_project):
    project = make_project(
        {
            "templates/base.yaml": NESTING,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block trainer\ntrainer: {lr: 3}\n-- endblock\n"
            ),
        }
    )
    assert render_config(project, "train").text.strip() == "trainer: {lr: 3}"


def test_block_moved_by_a_parent_into_another_block_is_rendered(make_project):
    project = make_project(
        {
            "templates/base.yaml": NESTING + "-- block other\n-- endblock\n",
            "templates/mid.yaml": (
                "-- extends 'base.yaml'\n-- block trainer\n-- endblock\n"
                "-- block other\nother:\n    -- block args\n    lr: 0.5\n    -- endblock\n"
                "-- endblock\n"
            ),
            "templates/configs/train.yaml": (
                "-- extends 'mid.yaml'\n-- block args\n    lr: 7\n-- endblock\n"
            ),
        }
    )
    assert render_config(project, "train").text.strip() == "other:\n    lr: 7"


def test_block_inside_a_parents_false_condition_is_a_warning(make_project, caplog):
    project = make_project(
        {
            "templates/base.yaml": (
                "a: 1\n-- if use_extra | default(false)\n-- block extra\nx: 1\n-- endblock\n"
                "-- endif\n"
            ),
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block extra\nx: 2\n-- endblock\n"
            ),
        }
    )
    assert render_config(project, "train").text.strip() == "a: 1"
    assert "block 'extra' is not rendered" in caplog.text
    assert "train.yaml:2" in caplog.text and "base.yaml:3" in caplog.text
    caplog.clear()
    assert "x: 2" in render_config(project, "train", {"use_extra": True}).text
    assert "not rendered" not in caplog.text


@pytest.mark.parametrize(
    ("text", "line"),
    [("max_steps: 50\n", 3), ("== super()\n", 3), ("-- if true\n  lr: 1\n-- endif\n", 4)],
)
def test_text_outside_any_block_of_a_child_is_located(make_project, text, line):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": "## a child\n-- extends 'base.yaml'\n" + text,
        }
    )
    (problem,) = render_problems(project)
    assert (problem.file, problem.line) == (str(project.configs_dir / "train.yaml"), line)
    assert "outside any block" in problem.message


def test_text_outside_blocks_names_the_block_that_holds_the_key(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": "-- extends 'base.yaml'\n\n    steps: 50\n",
        }
    )
    (problem,) = render_problems(project)
    assert problem.line == 3 and "'args'" in problem.hint


def test_statements_macros_and_blank_lines_outside_blocks_are_fine(make_project):
    project = make_project(
        {
            "templates/base.yaml": PARENT,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n\n-- set lr = 0.5\n-- macro m()\n  k: 1\n-- endmacro\n"
                "-- set text\nnot: output\n-- endset\n\n-- block extra\n== m()\n-- endblock\n"
            ),
        }
    )
    text = render_config(project, "train").text
    assert "lr: 0.5" in text and "  k: 1" in text and "not: output" not in text


def test_block_of_an_included_template_names_the_include(make_project):
    project = make_project(
        {
            "templates/base.yaml": "-- block model\n    -- include 'part.yaml'\n-- endblock\n",
            "templates/part.yaml": "model:\n    -- block inner\n    size: 1\n    -- endblock\n",
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block inner\n    size: 2\n-- endblock\n"
            ),
        }
    )
    (problem,) = render_problems(project)
    assert problem.line == 2 and "block 'inner' is not defined in any parent" in problem.message
    assert "'base.yaml' includes 'part.yaml' in block 'model'" in problem.hint
