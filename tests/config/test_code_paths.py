"""`./file.py:Name` specs load only from the project, its search paths and its code paths."""

from __future__ import annotations

import pytest

from forge.config import ConfigError, load_config, load_project
from tests.helpers import run_forge

EVIL = """\
import pathlib
pathlib.Path("pwned").touch()


def x():
    return 1
"""


@pytest.fixture
def outside(tmp_path):
    """tmp_path/elsewhere/evil.py, which creates `pwned` in the cwd when imported."""
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    (directory / "evil.py").write_text(EVIL)
    return directory


def test_build_refuses_a_file_that_climbs_out_of_the_project(config_project, outside):
    project = config_project("x: !call:./../elsewhere/evil.py:x []\n")
    result = run_forge("build", "train", "--target", "x", cwd=project.root)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert (
        "templates/configs/train.yaml:1: x: `./../elsewhere/evil.py` resolves to" in result.stderr
    )
    assert str(outside / "evil.py") in result.stderr
    assert "add its directory to code_paths in meta.yaml (code_paths: [../elsewhere])" in (
        result.stderr
    )
    assert not (project.root / "pwned").exists()


def test_ls_refuses_it_too(config_project, outside):
    project = config_project("x: !call:./../elsewhere/evil.py:x []\n")
    result = run_forge("ls", cwd=project.root)
    assert result.returncode == 2
    assert "outside the project directory" in result.stderr
    assert not (project.root / "pwned").exists()


def test_a_link_inside_the_project_to_a_file_outside_is_refused(config_project, outside):
    project = config_project("x: !call:./lib/link.py:x []\n")
    (project.root / "lib").mkdir()
    (project.root / "lib" / "link.py").symlink_to(outside / "evil.py")
    (problem,) = load_config(project, "train").check()
    assert f"`./lib/link.py` is a link to {outside / 'evil.py'}" in problem.message
    assert "code_paths: [../elsewhere]" in problem.hint
    assert not (project.root / "pwned").exists()


def test_a_link_to_a_directory_outside_is_refused(config_project, outside):
    project = config_project("x: !call:./lib/evil.py:x []\n")
    (project.root / "lib").symlink_to(outside)
    (problem,) = load_config(project, "train").check()
    assert "is a link to" in problem.message
    assert not (project.root / "pwned").exists()


def test_code_paths_allows_the_directory(config_project, outside, monkeypatch):
    project = config_project(
        "x: !call:./../elsewhere/evil.py:x []\n", meta="name: demo\ncode_paths: [../elsewhere]\n"
    )
    assert project.code_paths == [outside]
    monkeypatch.chdir(project.root)
    config = load_config(project, "train")
    assert config.check() == []
    assert config.build("x") == 1


def test_search_paths_allow_their_directory(config_project, outside, monkeypatch):
    project = config_project(
        "x: !call:./../elsewhere/evil.py:x []\n", meta="name: demo\nsearch_paths: [../elsewhere]\n"
    )
    monkeypatch.chdir(project.root)  # the check imports evil.py, which writes into the cwd
    assert project.code_roots == [project.root, outside]
    assert load_config(project, "train").check() == []


def test_project_files_below_the_root_still_load(config_project):
    project = config_project("x: !call:./sub/../helpers.py:Pair [1, 2]\n")
    pair = load_config(project, "train").build("x")
    assert (pair.left, pair.right) == (1, 2)


def test_code_paths_must_be_directories(tmp_path):
    (tmp_path / "meta.yaml").write_text("name: x\ncode_paths: [missing]\n")
    with pytest.raises(ConfigError) as info:
        load_project(tmp_path)
    (problem,) = info.value.problems
    assert problem.key_path == "code_paths" and "'missing' is not a directory" in problem.message
