"""check(): every kind of mistake, located, all reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.config import ConfigError, load_config


def problems_of(config_project, text: str, **kwargs):
    project = config_project(text, **kwargs.pop("project_kwargs", {}))
    return project, load_config(project, "train", **kwargs).check()


def only(problems):
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]


def test_clean_config_has_no_problems(config_project):
    _, problems = problems_of(
        config_project,
        """\
        thing: !singleton:./helpers.py:Thing {size: 1, scale: 2.0}
        add: !partial:operator:add [1]
        """,
    )
    assert problems == []


def test_unexpected_keyword_names_file_line_key_and_suggestion(config_project):
    project, problems = problems_of(
        config_project,
        """\
        trainer:
          args: !singleton:./helpers.py:Thing
            size: 1
            scal: 2.0
        """,
    )
    problem = only(problems)
    assert problem.file == str(project.configs_dir / "train.yaml")
    assert problem.line == 4
    assert problem.key_path == "trainer.args.scal"
    assert "Thing() got an unexpected keyword argument 'scal'" in problem.message
    assert "did you mean 'scale'?" in problem.message
    assert "(valid: size, name, scale)" in problem.message
    assert str(problem).endswith(
        "train.yaml:4: trainer.args.scal: Thing() got an unexpected keyword argument 'scal'; "
        "did you mean 'scale'? (valid: size, name, scale)"
    )


def test_missing_required_argument(config_project):
    _, problems = problems_of(
        config_project, "a: 1\nthing: !singleton:./helpers.py:Thing {name: x}\n"
    )
    problem = only(problems)
    assert (problem.line, problem.key_path) == (2, "thing")
    assert problem.message == "Thing() is missing the required argument 'size'"


def test_too_many_positional_arguments(config_project):
    _, problems = problems_of(config_project, "pair: !singleton:./helpers.py:Pair [1, 2, 3]\n")
    assert only(problems).message == "Pair() takes at most 2 positional arguments (3 given)"


def test_partial_may_leave_arguments_out(config_project):
    _, problems = problems_of(
        config_project,
        """\
        ok: !partial:./helpers.py:Pair [1]
        bad: !partial:./helpers.py:Pair {lef: 1}
        """,
    )
    problem = only(problems)
    assert problem.key_path == "bad.lef" and "did you mean 'left'" in problem.message


def test_unknown_module_suggests_sibling(config_project):
    _, problems = problems_of(config_project, "x: !singleton:forge.confg:Problem\n")
    problem = only(problems)
    assert problem.message == "no module named 'forge.confg'; did you mean 'forge.config'?"
    assert (problem.line, problem.key_path) == (1, "x")


def test_unknown_top_level_module_suggests_allowed_root(config_project):
    _, problems = problems_of(config_project, "x: !singleton:operatr:add\n", allow=["operatr"])
    assert "did you mean 'operator'?" in only(problems).message


def test_unknown_attribute_suggests(config_project):
    _, problems = problems_of(config_project, "\nx: !singleton:math:sqr 4\n")
    problem = only(problems)
    assert problem.message.startswith("'math' has no attribute 'sqr'; did you mean 'sqrt'")
    assert (problem.line, problem.key_path) == (2, "x")


def test_not_callable(config_project):
    _, problems = problems_of(config_project, "x: !singleton:math:pi\n")
    assert only(problems).message == "`math:pi` is not callable (it is float)"


def test_bad_spec_and_unknown_tag(config_project):
    _, problems = problems_of(
        config_project,
        """\
        a: !singleton:math.sqrt 4
        b: !singelton:math:sqrt 4
        c: !singleton
        d: !var
        """,
    )
    messages = [(p.key_path, p.message) for p in problems]
    assert (
        "a",
        "bad spec 'math.sqrt': separate the module from the attribute with ':'",
    ) in messages
    assert ("b", "unknown tag !singelton; did you mean 'singleton'?") in messages
    assert ("c", "!singleton needs a callable") in messages
    assert ("d", "!var needs a variable name (got '')") in messages
    assert next(p.hint for p in problems if p.key_path == "a") == "did you mean 'math:sqrt'?"


def test_outside_allow_list_names_meta_key_and_flag(config_project):
    project, problems = problems_of(config_project, "run: !singleton:os:system ls\n")
    problem = only(problems)
    assert problem.message.startswith(
        "`os:system` is outside the allowed module roots; add 'os' to allowed_modules in "
    )
    assert str(project.meta_file) in problem.message or "meta.yaml" in problem.message
    assert problem.message.endswith("or pass --allow os")
    assert problem.key_path == "run" and problem.line == 1


def test_allow_list_extended_by_meta_and_flag(config_project):
    _, problems = problems_of(
        config_project,
        "a: !partial:os.path:join\nb: !partial:json:dumps\n",
        allow=["json"],
        project_kwargs={"meta": "name: demo\nallowed_modules: [os.path]\n"},
    )
    assert problems == []


def test_harmful_builtins_refused(config_project):
    _, problems = problems_of(
        config_project,
        """\
        a: !call:eval '1'
        b: !call:builtins:open x
        c: !call:builtins:print x
        d: !call:len [[1]]
        """,
    )
    by_key = {p.key_path: p.message for p in problems}
    assert set(by_key) == {"a", "b", "c"}
    assert "refused" in by_key["a"] and "refused" in by_key["b"]
    assert "--allow builtins" in by_key["c"]


def test_modules_reached_through_attributes_are_checked(make_project):
    project = make_project(
        {
            "tools.py": "import os\n",
            "templates/configs/train.yaml": "x: !singleton:./tools.py:os.system ls\n",
        }
    )
    problem = only(load_config(project, "train").check())
    assert "`./tools.py:os.system` is outside the allowed module roots" in problem.message


def test_three_mistakes_reported_at_once(config_project):
    project = config_project(
        """\
        model: !singleton:forge.confg:Problem
        trainer:
          args: !singleton:./helpers.py:Thing
            size: 1
            max_stepz: 3
        hook: !singleton:subprocess:run [ls]
        """
    )
    config = load_config(project, "train")
    problems = config.check()
    assert [(p.line, p.key_path) for p in problems] == [
        (1, "model"),
        (5, "trainer.args.max_stepz"),
        (6, "hook"),
    ]
    assert all(Path(p.file).name == "train.yaml" for p in problems)
    with pytest.raises(ConfigError) as info:
        config.build("model")
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("3 problems in config 'train.yaml':\n")


def test_problem_without_template_line_shows_rendered_context(config_project):
    # Only the last line of a multi-line expression value carries a template location.
    project = config_project(
        """\
        -- set spec = "x: !singleton:math:nope 1\\ny: 2"
        a: 1
        {{ spec }}
        """
    )
    config = load_config(project, "train")
    assert config.text == "a: 1\nx: !singleton:math:nope 1\ny: 2\n"
    problem = only(config.check())
    assert problem.file is None and problem.line == 2
    assert ">    2 | x: !singleton:math:nope 1" in problem.context
    assert "     1 | a: 1" in problem.context
    assert str(problem).startswith("rendered line 2: x: 'math' has no attribute 'nope'")


def test_yaml_syntax_error_is_located(config_project):
    project = config_project("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(project, "train")
    problem = only(info.value.problems)
    assert "invalid YAML" in problem.message
    assert Path(problem.file).name == "train.yaml" and problem.line in (2, 3)


def test_check_does_not_build(config_project, tmp_path):
    marker = tmp_path / "built"
    project = config_project("x: !singleton:./side.py:touch\n")
    (project.root / "side.py").write_text(
        f"import pathlib\ndef touch():\n    pathlib.Path({str(marker)!r}).write_text('x')\n"
    )
    config = load_config(project, "train")
    assert config.check() == []
    assert not marker.exists()
    config.build("x")
    assert marker.exists()


def test_callable_with_kwargs_takes_any_keyword(config_project):
    _, problems = problems_of(config_project, "c: !call:./helpers.py:collect {any: 1, other: 2}\n")
    assert problems == []


def test_a_transformers_configs_unknown_key_is_an_error_with_its_line(config_project):
    """BartConfig keeps ``encoder_layres`` as an attribute no model reads and builds the default
    12 layers: a key the class does not take is an error at its line, with the near name; the
    keys transformers' configs take in common (id2label, num_labels, an attribute_map alias,
    a legacy name the class reads, a generation setting) pass."""
    _, problems = problems_of(
        config_project,
        """\
        bart: !singleton:transformers:BartConfig
            vocab_size: 64
            encoder_layres: 2
            num_labels: 3
            id2label: {0: a, 1: b, 2: c}
            hidden_size: 16
            num_beams: 2
            tokenizer_class: BartTokenizer
        llama: !singleton:transformers:LlamaConfig {rope_scaling: null, torch_dtype: float32}
        """,
    )
    problem = only(problems)
    assert problem.file.endswith("templates/configs/train.yaml"), str(problem)
    assert (problem.line, problem.key_path) == (3, "bart.encoder_layres"), str(problem)
    assert "BartConfig() has no setting 'encoder_layres'" in problem.message
    assert problem.message.endswith("; did you mean 'encoder_layers'?")


def test_a_projects_own_config_class_takes_extra_keywords_with_a_warning(config_project, caplog):
    """Only transformers' own classes are held to their keys: a project's subclass may keep
    attributes of its own (a near miss of a named key is still a warning)."""
    project = config_project(
        """\
        mine: !singleton:./custom.py:MyConfig
            hidden_size: 64
            hidden_sise: 64
            my_flag: true
        """
    )
    (project.root / "custom.py").write_text(
        "from transformers import BertConfig\n\nclass MyConfig(BertConfig):\n    pass\n"
    )
    assert load_config(project, "train").check() == []
    (record,) = [r for r in caplog.records if "passed on as is" in r.getMessage()]
    assert "train.yaml:3: mine.hidden_sise: MyConfig() takes any keyword" in record.getMessage()


def test_closed_signature_typo_is_still_flagged(config_project):
    _, problems = problems_of(
        config_project,
        "lin: !singleton:torch.nn:Linear {in_features: 2, out_features: 3, biass: 1}\n",
    )
    problem = only(problems)
    assert problem.key_path == "lin.biass"
    assert "unexpected keyword argument 'biass'; did you mean 'bias'?" in problem.message


def test_a_local_path_that_does_not_exist_is_named_before_the_hub_is_asked(
    config_project, tmp_path
):
    """transformers would take it for a Hub name and fail after a minute of retries."""
    there = tmp_path / "tok"
    there.mkdir()
    _, problems = problems_of(
        config_project,
        f"""\
        tokenizer: !singleton:transformers:AutoTokenizer.from_pretrained ["{tmp_path}/tokz"]
        same: !singleton:transformers:AutoTokenizer.from_pretrained ["{there}"]
        hub: !singleton:transformers:AutoTokenizer.from_pretrained ["org/name"]
        """,
    )
    problem = only(problems)
    assert (problem.line, problem.key_path) == (1, "tokenizer.0")
    assert f"'{tmp_path}/tokz' looks like a local path, and there is nothing there" in str(problem)
    assert "joinpath(project_dir" in str(problem)
