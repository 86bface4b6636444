"""`forge vars`: each variable a config reads, with its value, default and where."""

from __future__ import annotations

from forge.config import render_config
from forge.config.render import builtin_variables
from forge.config.variables import VariableRow, variable_rows


def test_rows_for_defines_sets_defaults_and_builtins(make_project, monkeypatch):
    project = make_project(
        {
            "templates/base.yaml": (
                "-- set width = width | default(64)\n"
                "name: {{ project_name }}\n"
                "-- for item in [1, 2]\n"
                "i{{ item }}: {{ item }}\n"
                "-- endfor\n"
                "-- block body\n"
                "steps: {{ steps | default(10) }}\n"
                "-- endblock\n"
                "w: {{ width }}\n"
            ),
            "templates/configs/train.yaml": (
                "-- extends 'base.yaml'\n"
                "-- set width = 128\n"
                "-- block body\n"
                "steps: {{ steps | default(20) }}\n"
                "lr: {{ lr }}\n"
                "-- endblock\n"
            ),
        }
    )
    monkeypatch.chdir(project.root)
    defines = {"lr": 0.5}
    rendered = render_config(project, "train", defines)
    rows = variable_rows(rendered, defines, builtin_variables(project, "train.yaml"))
    assert rows == [
        VariableRow("lr", value="0.5", where="-D"),
        VariableRow("project_name", value="demo", where="forge"),
        VariableRow("steps", default="20", where="templates/configs/train.yaml:4"),
        VariableRow("steps", default="10", where="templates/base.yaml:7"),
        VariableRow("width", value="128", where="templates/configs/train.yaml:2"),
        VariableRow("width", default="64", where="templates/base.yaml:1"),
    ]
