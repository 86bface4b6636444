"""The helper functions templates can call: pure, no file is read or stat'ed."""

from __future__ import annotations

import os
from datetime import datetime

import pytest

from forge.config import render_config
from forge.config.functions import FUNCTION_NAMES, template_functions

WHEN = datetime(2025, 3, 1, 14, 5, 9)
STAMP = WHEN.timestamp()


@pytest.fixture
def fn():
    return template_functions(WHEN)


def test_every_listed_function_exists(fn):
    assert sorted(fn) == sorted(FUNCTION_NAMES)


def test_path_helpers(fn):
    assert fn["joinpath"]("a", "b", "c.txt") == os.path.join("a", "b", "c.txt")
    assert fn["joinpath"]("/root", 3) == os.path.join("/root", "3")
    assert fn["normpath"]("a/./b/../c//d") == os.path.normpath("a/c/d")
    assert fn["basename"]("a/b.yaml") == "b.yaml"
    assert fn["dirname"]("a/b.yaml") == "a"
    assert fn["splitext"]("a/b.tar.gz") == ("a/b.tar", ".gz")


def test_time_helpers_format_numbers_or_the_render_time(fn):
    assert fn["now"]() == "2025-03-01T14:05:09"
    assert fn["now"]("%Y%m%d") == "20250301"
    assert fn["isotime"]() == "2025-03-01T14:05:09"
    assert fn["isotime"](STAMP) == "2025-03-01T14:05:09"
    assert fn["filetime"]() == "2025-03-01T14-05-09"
    assert fn["filetime"](STAMP + 60, "%H%M") == "1406"


def test_filetime_never_looks_at_a_file(fn, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a template function touched the file system")

    for name in ("stat", "lstat", "open", "listdir", "scandir"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr("builtins.open", refuse)
    for name, args in [
        ("filetime", ()),
        ("filetime", (STAMP,)),
        ("isotime", ()),
        ("now", ()),
        ("joinpath", ("a", "b")),
        ("normpath", ("a/../b",)),
        ("basename", ("a/b",)),
        ("dirname", ("a/b",)),
        ("splitext", ("a.b",)),
    ]:
        fn[name](*args)


def test_functions_in_a_template(config_project):
    project = config_project(
        "out: {{ joinpath(output_root, 'runs', basename('x/y.txt')) }}\n"
        "stem: {{ splitext('model.tar')[0] }}\n"
        "stamp: {{ filetime() }}\n"
        "same: {{ now() == isotime() }}\n"
    )
    lines = render_config(project, "train").text.splitlines()
    assert lines[0] == f"out: {os.path.join(str(project.output_dir), 'runs', 'y.txt')}"
    assert lines[1] == "stem: model"
    assert len(lines[2]) == len("stamp: 2025-03-01T14-05-09") and ":" not in lines[2][7:]
    assert lines[3] == "same: True"
