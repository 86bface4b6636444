"""Rendering: inheritance, inline templates, search path, variables, provenance and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.config import ConfigError, parse_define, render_config
from forge.config import project as project_module

BASE_PROJECT = """\
model: base-model
-- block trainer
trainer: none
-- endblock
"""
BASE_TRAINER = """\
trainer:
  kind: plain
  args:
-- block trainer_args
    lr: 1e-3
    max_steps: 10
-- endblock
"""
DESIGN_EXAMPLE = """\
-- extends 'projects/causal_lm.yaml'
-- block trainer
    -- include 'my.trainer'
-- endblock
#-------- my.trainer --------
-- extends 'trainers/trainer.yaml'
-- block trainer_args
    == super()
    max_steps: 200
    save_steps: 50
-- endblock
"""


@pytest.fixture
def design_project(make_project):
    return make_project(
        {
            "templates/projects/causal_lm.yaml": BASE_PROJECT,
            "templates/trainers/trainer.yaml": BASE_TRAINER,
            "templates/configs/train.yaml": DESIGN_EXAMPLE,
        }
    )


def test_inline_template_extends_second_base(design_project):
    rendered = render_config(design_project, "train")
    lines = [line for line in rendered.text.splitlines() if line.strip()]
    assert lines == [
        "model: base-model",
        "trainer:",
        "  kind: plain",
        "  args:",
        "    lr: 1e-3",
        "    max_steps: 10",
        "    max_steps: 200",
        "    save_steps: 50",
    ]
    names = [name for name, _ in rendered.chain]
    assert names == [
        "configs/train.yaml",
        "projects/causal_lm.yaml",
        "my.trainer",
        "trainers/trainer.yaml",
    ]
    assert rendered.chain[2][1] == str(design_project.configs_dir / "train.yaml")


def test_source_map_through_extends_blocks_super_and_include(design_project):
    rendered = render_config(design_project, "train")
    root = design_project.templates_dir
    where = {
        line: rendered.source_map[number]
        for number, line in enumerate(rendered.text.split("\n"), start=1)
        if line.strip()
    }
    assert where["model: base-model"] == (str(root / "projects/causal_lm.yaml"), 1)
    assert where["  kind: plain"] == (str(root / "trainers/trainer.yaml"), 2)
    assert where["    lr: 1e-3"] == (str(root / "trainers/trainer.yaml"), 5)
    assert where["    max_steps: 200"] == (str(root / "configs/train.yaml"), 9)
    assert where["    save_steps: 50"] == (str(root / "configs/train.yaml"), 10)


def test_source_map_through_macros(config_project):
    project = config_project(
        """\
        -- macro entry(n)
        key{{ n }}: {{ n }}
        -- endmacro
        first: 1
        == entry(7)
        """
    )
    rendered = render_config(project, "train")
    config_file = str(project.configs_dir / "train.yaml")
    assert rendered.text.split("\n")[:2] == ["first: 1", "key7: 7"]
    assert rendered.source_map[1] == (config_file, 4)
    assert rendered.source_map[2] == (config_file, 2)


def test_project_templates_beat_search_paths_and_library(make_project, tmp_path, monkeypatch):
    library = tmp_path / "library"
    (library / "base").mkdir(parents=True)
    (library / "base" / "a.yaml").write_text("from: library-a\n")
    (library / "base" / "b.yaml").write_text("from: library-b\n")
    (library / "base" / "c.yaml").write_text("from: library-c\n")
    extra = tmp_path / "extra"
    (extra / "base").mkdir(parents=True)
    (extra / "base" / "b.yaml").write_text("from: extra-b\n")
    (extra / "base" / "c.yaml").write_text("from: extra-c\n")
    monkeypatch.setattr(project_module, "LIBRARY_DIR", library)
    project = make_project(
        {
            "templates/base/c.yaml": "from: project-c\n",
            "templates/configs/train.yaml": (
                "-- include 'base/a.yaml'\n-- include 'base/b.yaml'\n-- include 'base/c.yaml'\n"
            ),
        },
        meta="name: demo\nsearch_paths: [../extra]\n",
    )
    assert project.search_paths == [extra]
    text = render_config(project, "train").text
    assert text == "from: library-a\nfrom: extra-b\nfrom: project-c\n"


def test_inline_template_beats_search_path(make_project):
    project = make_project(
        {
            "templates/part.yaml": "from: file\n",
            "templates/configs/train.yaml": "-- include 'part.yaml'\n#---- part.yaml ----\nfrom: inline\n",
        }
    )
    assert render_config(project, "train").text == "from: inline\n"


def test_variables_reach_parents_includes_and_imports(make_project):
    project = make_project(
        {
            "templates/base.yaml": "steps: {{ max_steps }}\n-- block rest\n-- endblock\n",
            "templates/part.yaml": "part_steps: {{ max_steps * 2 }}\n",
            "templates/macros.yaml": "-- macro m()\nm: {{ max_steps }}\n-- endmacro\n",
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n"
                "-- block rest\n"
                "-- include 'part.yaml'\n"
                "-- import 'macros.yaml' as macros\n"
                "== macros.m()\n"
                "-- endblock\n"
            ),
        }
    )
    text = render_config(project, "train", {"max_steps": 20}).text
    assert [line for line in text.splitlines() if line] == [
        "steps: 20",
        "part_steps: 40",
        "m: 20",
    ]


def test_builtin_variables(config_project):
    project = config_project(
        "dir: {{ project_dir }}\nname: {{ project_name }}\n"
        "config: {{ config_name }}\nout: {{ output_root }}\n"
    )
    text = render_config(project, "train.yaml").text
    assert text.splitlines() == [
        f"dir: {project.root}",
        "name: demo",
        "config: train",
        f"out: {project.root / 'output'}",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_steps=20", ("max_steps", 20)),
        ("x=true", ("x", True)),
        ("s=abc", ("s", "abc")),
        ("lr=1e-3", ("lr", 0.001)),
        ("f=2.5", ("f", 2.5)),
        ("n=null", ("n", None)),
        ("e=", ("e", "")),
        ("q=a: b", ("q", "a: b")),
        ("l=[1, 2]", ("l", [1, 2])),
    ],
)
def test_parse_define_types(text, expected):
    assert parse_define(text) == expected


@pytest.mark.parametrize(
    ("define", "expected"),
    [
        ("v=null", None),  # YAML's null is off, not the string 'None'
        ("v=~", None),
        ("v=true", True),
        ("v=false", False),
        ("v=[1, null, true, abc]", [1, None, True, "abc"]),
        ("v={a: null, b: [x]}", {"a": None, "b": ["x"]}),
        ("v=20", 20),
        ("v=1e-5", 1e-5),
        ("v=abc", "abc"),
        ("v=None", "None"),  # not YAML's null: a string, as YAML reads it
        ("v=[it's, 'a: b', null]", ["it's", "a: b", None]),
    ],
)
def test_a_define_renders_as_the_yaml_value_it_was_read_as(config_project, define, expected):
    """`-D v=VALUE` is read as YAML; `{{ v }}` writes it back so the rendered YAML reads the
    same value: null is null (no 'None'), true is true, inside lists and mappings too."""
    from forge.config.yaml_io import parse_value

    project = config_project("x: {{ v | default(0.5) }}\n")
    name, value = parse_define(define)
    assert value == expected
    text = render_config(project, "train", {name: value}).text
    assert parse_value(text.partition(": ")[2]) == expected, text


@pytest.mark.parametrize("text", ["novalue", "=3", "bad-name=1", "1x=2"])
def test_parse_define_rejects_bad_syntax(text):
    with pytest.raises(ConfigError, match="expected NAME=VALUE"):
        parse_define(text)


def test_undefined_variable_names_file_and_line(make_project):
    project = make_project(
        {
            "templates/base.yaml": "a: 1\nb: {{ foo }}\n",
            "templates/configs/train.yaml": "-- extends 'base.yaml'\n",
        }
    )
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert problem.file == str(project.templates_dir / "base.yaml")
    assert problem.line == 2
    assert "'foo' is undefined" in problem.message
    assert problem.hint == "define it with -D foo=VALUE or set it in the template"
    assert "base.yaml:2: 'foo' is undefined" in str(info.value)


def test_syntax_error_names_file_and_line(config_project):
    project = config_project("a: 1\nb: 2\n-- if\n-- endif\n")
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert (Path(problem.file).name, problem.line) == ("train.yaml", 3)
    assert "template syntax error" in problem.message


@pytest.mark.parametrize("use_it", [True, False])
def test_syntax_error_inside_inline_template(config_project, use_it):
    include = "-- include 'sub'\n" if use_it else ""
    project = config_project(f"{include}a: 1\n#---- sub ----\nx: 1\ny: 2\n-- for\n")
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert (Path(problem.file).name, problem.line) == ("train.yaml", 6 if use_it else 5)
    assert "'sub'" in problem.message


def test_template_not_found_suggests_and_locates(make_project):
    project = make_project(
        {
            "templates/trainers/trainer.yaml": "t: 1\n",
            "templates/configs/train.yaml": "a: 1\n-- include 'trainers/trainr.yaml'\n",
        }
    )
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert "'trainers/trainr.yaml' not found" in problem.message
    assert str(project.templates_dir.name) in problem.message  # the search path is listed
    assert "trainers/trainer.yaml" in problem.hint
    assert (Path(problem.file).name, problem.line) == ("train.yaml", 2)


def test_template_not_found_suggests_by_basename(make_project):
    project = make_project(
        {
            "templates/trainers/plain.yaml": "t: 1\n",
            "templates/configs/train.yaml": "-- extends 'plain.yaml'\n",
        }
    )
    with pytest.raises(ConfigError, match="did you mean 'trainers/plain.yaml'"):
        render_config(project, "train")


def test_runtime_error_in_template_is_located(config_project):
    project = config_project("a: 1\nb: {{ 1 // 0 }}\n")
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert problem.line == 2
    assert "ZeroDivisionError" in problem.message


def test_missing_config_suggests(config_project):
    project = config_project("a: 1\n")
    with pytest.raises(ConfigError) as info:
        render_config(project, "trian")
    message = str(info.value)
    assert "no config 'trian'" in message and "train.yaml" in message


def test_unclosed_comment_is_located_in_its_file(config_project):
    project = config_project("a: 1\nb: 2 {# never closed\nc: 3\n")
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert (problem.file, problem.line) == (str(project.configs_dir / "train.yaml"), 2)
    assert "Missing end of comment tag" in problem.message
