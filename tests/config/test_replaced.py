"""A `-D` variable read only into keys that a later key replaces changes nothing: an error."""

from __future__ import annotations

import pytest

from forge.config import ConfigError, load_config, render_config
from forge.config.replaced import replaced_pairs

BASE = """\
args: &args
    -- block args
    lr: {{ lr | default(0.1) }}
    steps: 10
    -- endblock
again: *args
"""


def test_define_read_only_into_a_replaced_key_is_located(make_project, monkeypatch):
    project = make_project(
        {
            "templates/base.yaml": BASE,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n    lr: 0.5\n-- endblock\n"
            ),
        }
    )
    monkeypatch.chdir(project.root)
    with pytest.raises(ConfigError) as info:
        render_config(project, "train", {"lr": 3})
    (problem,) = info.value.problems
    assert problem.message.startswith("-D lr: every line that reads 'lr' writes a key")
    assert "templates/base.yaml:3 by templates/configs/train.yaml:4" in problem.message
    assert (problem.file, problem.line) == (str(project.configs_dir / "train.yaml"), 4)
    assert "{{ lr | default(...) }}" in problem.hint
    assert "lr: 0.5" in render_config(project, "train").text  # without the -D: fine


def test_define_that_reaches_a_winning_key_is_read(make_project):
    project = make_project(
        {
            "templates/base.yaml": BASE,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n"
                "    lr: {{ lr | default(0.5) }}\n-- endblock\n"
            ),
        }
    )
    assert "    lr: 3" in render_config(project, "train", {"lr": 3}).text


def test_define_read_by_a_statement_is_never_reported(make_project):
    project = make_project(
        {
            "templates/base.yaml": "-- set lr = lr | default(0.1)\n" + BASE,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n    lr: 0.5\n-- endblock\n"
            ),
        }
    )
    assert "lr: 0.5" in render_config(project, "train", {"lr": 3}).text


def test_a_replaced_value_an_alias_reaches_is_not_replaced():
    text = "a:\n  x: &v {k: 1}\n  x: 2\nb: *v\nc:\n  y: 1\n  z: 2\n  y: 3\n"
    assert replaced_pairs(text) == {6: 8}


def test_ls_counts_only_reads_into_kept_keys(make_project):
    project = make_project(
        {
            "templates/base.yaml": BASE,
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n-- block args\n    == super()\n    lr: 0.5\n-- endblock\n"
            ),
        }
    )
    cfg = load_config(project, "train", {"lr": 3}, check_variables=False)
    assert "lr" not in cfg.variables_read() and "steps" not in cfg.variables_read()
