"""`render --resolved`: duplicate keys merged, a provenance comment per key; `--graph`
locates plain values too."""

from __future__ import annotations

from forge.config import load_config, parse_config

BASE = """\
.args: &args !call:./helpers.py:collect
-- block args
    size: 1
    name: small
-- endblock
top:
  shared: *args
  again: *args
  items:
    - 1
    - {a: 1}
  text: "two\\nlines"
  empty: {}
"""
CONFIG = """\
-- extends 'base.yaml'
-- block args
    == super()
    name: big
    size: 3
-- endblock
"""


def resolved_project(make_project):
    return make_project({"templates/base.yaml": BASE, "templates/configs/train.yaml": CONFIG})


def test_each_key_once_with_its_winning_value_and_line(make_project, monkeypatch):
    project = resolved_project(make_project)
    monkeypatch.chdir(project.root)
    config = load_config(project, "train")
    text = config.resolved_text()
    lines = text.splitlines()
    assert "  size: 3  # templates/configs/train.yaml:5" in lines
    assert "  name: big  # templates/configs/train.yaml:4" in lines
    assert sum(line.lstrip().startswith("size:") for line in lines) == 1, text
    assert lines[0] == ".args: &args !call:./helpers.py:collect  # templates/base.yaml:1"
    assert "  again: *args  # templates/base.yaml:8" in lines


def test_resolved_text_builds_the_same_objects(make_project, monkeypatch):
    project = resolved_project(make_project)
    monkeypatch.chdir(project.root)
    config = load_config(project, "train")
    again = parse_config(config.resolved_text(), project=project)
    assert again.check() == []
    assert again.build("top") == config.build("top")
    built = again.build("top")
    assert built["shared"] is built["again"]
    assert built["shared"] == ((), {"size": 3, "name": "big"})
    assert built["text"] == "two\nlines" and built["empty"] == {}


def test_set_values_name_the_flag(make_project, monkeypatch):
    project = resolved_project(make_project)
    monkeypatch.chdir(project.root)
    config = load_config(project, "train", overrides=["top.text=x", ".args.extra=1"])
    lines = config.resolved_text().splitlines()
    assert "  text: x  # --set top.text=x" in lines
    assert "  extra: 1  # --set .args.extra=1" in lines


def test_graph_shows_where_plain_values_come_from(make_project, monkeypatch):
    project = resolved_project(make_project)
    monkeypatch.chdir(project.root)
    graph = load_config(project, "train").describe_graph().splitlines()
    assert "  size: 3  [templates/configs/train.yaml:5]" in graph
    assert "  text: 'two\\nlines'  [templates/base.yaml:12]" in graph
    assert "  again: *.args (shared)  [templates/base.yaml:8]" in graph
