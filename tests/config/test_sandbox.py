"""Templates run sandboxed: sandbox-escape payloads fail located, with no side effect."""

from __future__ import annotations

import pytest

from forge.config import ConfigError, render_config
from forge.config.functions import FUNCTION_NAMES
from forge.config.sandbox import ALLOWED_FILTERS, ALLOWED_GLOBALS, ALLOWED_TESTS
from tests.helpers import run_forge

# Each would create the file `pwned` in the working directory if it escaped the sandbox.
ESCAPES = {
    "cycler": "x: \"{{ cycler.__init__.__globals__.os.system('touch pwned') }}\"",
    "joiner": "x: \"{{ joiner.__init__.__globals__.os.popen('touch pwned').read() }}\"",
    "namespace": "x: {{ namespace.__init__.__globals__.os.system('touch pwned') }}",
    "lipsum": "x: {{ lipsum.__globals__['os'].system('touch pwned') }}",
    "self": (
        "x: {{ self.__init__.__globals__.__builtins__.__import__('os').system('touch pwned') }}"
    ),
    "subclasses": (
        "x: {{ ().__class__.__base__.__subclasses__()[100].__init__.__globals__['sys']"
        ".modules.os.system('touch pwned') }}"
    ),
    "mro": "x: {{ ''.__class__.__mro__[1].__subclasses__() }}",
    "getitem": "x: {{ ''['__class__']['__mro__'][1]['__subclasses__']() }}",
    "attr-filter": "x: {{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "format": "x: \"{{ '{0.__class__.__mro__}'.format('') }}\"",
    "private": "x: {{ self._TemplateReference__context.environment }}",
    "statement": "-- set y = cycler.__init__.__globals__.os.system('touch pwned')\nx: 1",
    "dead-branch": "-- if false\nx: {{ cycler.__init__.__globals__ }}\n-- endif\nx: 1",
}
# The line of each payload that the error must point at.
LINES = {"dead-branch": 2}


def payload_project(make_project, names):
    files = {f"templates/configs/{name}.yaml": ESCAPES[name] + "\n" for name in names}
    return make_project(files)


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_is_refused_in_process(make_project, name):
    project = payload_project(make_project, [name])
    with pytest.raises(ConfigError) as info:
        render_config(project, name)
    (problem,) = info.value.problems
    assert problem.message.startswith("unsafe template"), problem.message
    assert problem.file == str(project.configs_dir / f"{name}.yaml")
    assert problem.line == LINES.get(name, 1)
    assert not (project.root / "pwned").exists()


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_render_refuses_escape(make_project, name):
    project = payload_project(make_project, [name])
    result = run_forge("render", name, cwd=project.root)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"templates/configs/{name}.yaml:{LINES.get(name, 1)}: unsafe template" in result.stderr
    assert result.stdout == ""
    assert not (project.root / "pwned").exists()


def test_ls_refuses_every_escape(make_project):
    project = payload_project(make_project, ESCAPES)
    result = run_forge("ls", cwd=project.root)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for name in ESCAPES:
        assert f"templates/configs/{name}.yaml:{LINES.get(name, 1)}: unsafe" in result.stderr
    assert not (project.root / "pwned").exists()


@pytest.mark.parametrize("name", ["cycler", "subclasses", "statement", "format"])
def test_build_refuses_escape(make_project, name):
    project = payload_project(make_project, [name])
    result = run_forge("build", name, "--target", "x", cwd=project.root)
    assert result.returncode == 2
    assert f"templates/configs/{name}.yaml:{LINES.get(name, 1)}: unsafe template" in result.stderr
    assert not (project.root / "pwned").exists()


def test_escape_in_a_parent_template_is_located_there(make_project):
    project = make_project(
        {
            "templates/base.yaml": "a: 1\n" + ESCAPES["cycler"] + "\n",
            "templates/configs/train.yaml": "-- extends 'base.yaml'\n",
        }
    )
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert (problem.file, problem.line) == (str(project.templates_dir / "base.yaml"), 2)


def test_escape_in_an_unused_inline_template_is_refused(make_project):
    project = make_project(
        {"templates/configs/train.yaml": "a: 1\n#---- unused ----\n" + ESCAPES["lipsum"] + "\n"}
    )
    with pytest.raises(ConfigError, match="unsafe template"):
        render_config(project, "train")


def test_template_link_out_of_the_search_path_is_refused(make_project, tmp_path):
    secret = tmp_path / "secret.yaml"
    secret.write_text("password: hunter2\n")
    project = make_project({"templates/configs/train.yaml": "a: 1\n-- include 'leak.yaml'\n"})
    (project.templates_dir / "leak.yaml").symlink_to(secret)
    with pytest.raises(ConfigError) as info:
        render_config(project, "train")
    (problem,) = info.value.problems
    assert "'leak.yaml' is a link to" in problem.message and "search_paths" in problem.message
    assert problem.line == 2


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("'x' * 10 ** 8", "repeated 100000000 times"),
        ("[0] * 100000000", "repeated 100000000 times"),
        ("2 ** (10 ** 9)", "larger than 100000 bits"),
    ],
)
def test_huge_values_are_refused_not_computed(config_project, expression, message):
    project = config_project(f"x: {{{{ {expression} }}}}\n")
    with pytest.raises(ConfigError, match=message):
        render_config(project, "train")


def test_ordinary_arithmetic_and_methods_still_work(config_project):
    project = config_project(
        "a: {{ 2 ** 10 }}\nb: {{ '-' * 3 }}\nc: {{ 'a,b'.split(',') | join('+') }}\n"
        "d: {{ '{}-{}'.format(1, 2) }}\ne: {{ range(3) | list }}\nf: {{ dict(k=1).k }}\n"
    )
    text = render_config(project, "train").text
    assert text.splitlines() == ["a: 1024", "b: ---", "c: a+b", "d: 1-2", "e: [0, 1, 2]", "f: 1"]


@pytest.mark.parametrize("name", ["cycler", "joiner", "namespace", "lipsum"])
def test_jinja_default_globals_are_gone(config_project, name):
    project = config_project(f"x: {{{{ {name} }}}}\n")
    with pytest.raises(ConfigError, match=f"'{name}' is undefined"):
        render_config(project, "train")


@pytest.mark.parametrize("name", ["random", "pprint", "safe", "urlize", "xmlattr"])
def test_left_out_filters_are_unknown(config_project, name):
    project = config_project(f"x: {{{{ 1 | {name} }}}}\n")
    with pytest.raises(ConfigError, match=f"No filter named '{name}'"):
        render_config(project, "train")


def test_readme_lists_exactly_the_allowed_names():
    from tests import docs

    section = docs.section("What templates can use")
    for name in ALLOWED_FILTERS:
        assert f"`{name}`" in section, name
    for name in [*ALLOWED_GLOBALS, *FUNCTION_NAMES]:
        assert f"`{name}" in section, name
    assert "Jinja's tests" in section and len(ALLOWED_TESTS) > 30
