"""Projects: meta.yaml, discovery, config names; and that forge.config stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import forge
from forge.config import LIBRARY_DIR, ConfigError, find_project, load_project


def test_meta_fields(make_project, tmp_path):
    (tmp_path / "shared").mkdir()
    project = make_project(
        {"templates/configs/train.yaml": "a: 1\n"},
        meta="""\
        name: lm
        description: a small LM
        default_config: train
        search_paths: [../shared]
        allowed_modules: [numpy]
        """,
    )
    assert project.name == "lm" and project.description == "a small LM"
    assert project.default_config == "train"
    assert project.search_paths == [(tmp_path / "shared").resolve()]
    assert project.allowed_modules == ["numpy"]
    assert project.templates_dir == project.root / "templates"
    assert project.configs_dir == project.root / "templates" / "configs"
    assert project.output_dir == project.root / "output"


def test_name_defaults_to_directory(make_project):
    project = make_project({}, meta="")
    assert project.name == "proj"


def test_unknown_meta_key(make_project):
    with pytest.raises(ConfigError) as info:
        make_project({}, meta="name: x\nallowed_module: [os]\n")
    (problem,) = info.value.problems
    assert problem.file.endswith("meta.yaml") and problem.key_path == "allowed_module"
    assert "unknown key 'allowed_module'; did you mean 'allowed_modules'?" in problem.message
    assert "name, description, default_config, search_paths, code_paths, allowed_modules" in (
        problem.hint
    )


def test_bad_meta_values(make_project):
    with pytest.raises(ConfigError) as info:
        make_project({}, meta="name: [x]\nsearch_paths: [missing]\nallowed_modules: 3\n")
    keys = sorted(p.key_path for p in info.value.problems)
    assert keys == ["allowed_modules", "name", "search_paths"]


def test_missing_meta(tmp_path):
    with pytest.raises(ConfigError, match="no meta.yaml"):
        load_project(tmp_path)


def test_a_project_directory_that_does_not_exist_says_so(tmp_path):
    with pytest.raises(ConfigError) as missing:
        load_project(tmp_path / "nope")
    assert str(missing.value).startswith(f"no such directory: {tmp_path / 'nope'}")
    (tmp_path / "file.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError) as a_file:
        load_project(tmp_path / "file.yaml")
    assert "is a file, not a project directory" in str(a_file.value)


def test_find_project_from_nested_directory(make_project, monkeypatch):
    project = make_project({"templates/configs/train.yaml": "a: 1\n"})
    nested = project.root / "templates" / "configs"
    assert find_project(nested).root == project.root
    monkeypatch.chdir(nested)
    assert find_project().root == project.root


def test_find_project_fails_helpfully(tmp_path):
    with pytest.raises(ConfigError) as info:
        find_project(tmp_path)
    message = str(info.value)
    assert message == (
        f"no forge project found in {tmp_path.resolve()} or its parents; "
        "pass -p DIR or create meta.yaml"
    )


def test_list_and_resolve_configs(make_project):
    project = make_project(
        {"templates/configs/train.yaml": "a: 1\n", "templates/configs/sub/x.yaml": "b: 1\n"}
    )
    assert project.list_configs() == ["sub/x.yaml", "train.yaml"]
    for name in ("train", "train.yaml", "configs/train.yaml", "templates/configs/train.yaml"):
        assert project.resolve_config_name(name) == "train.yaml"
    assert project.resolve_config_name("sub/x") == "sub/x.yaml"
    with pytest.raises(ConfigError) as info:
        project.resolve_config_name("trian")
    (problem,) = info.value.problems
    assert "available: sub/x.yaml, train.yaml" in problem.message
    assert problem.hint == "did you mean 'train.yaml'?"


def test_library_dir_of_a_source_tree_is_the_top_level_templates():
    assert LIBRARY_DIR == Path(forge.__file__).resolve().parent.parent / "templates"
    assert (LIBRARY_DIR / "base.yaml").is_file()


def test_library_dir_of_an_installed_package_is_inside_it(tmp_path, monkeypatch):
    from forge.config.project import _library_dir

    site = tmp_path / "site-packages"
    package = site / "forge"
    (package / "templates").mkdir(parents=True)
    (site / "templates").mkdir()  # some other distribution's: never used
    monkeypatch.setattr(forge, "__file__", str(package / "__init__.py"))
    assert _library_dir() == package / "templates"
    (package / "templates").rmdir()
    assert _library_dir() == package / "templates"  # broken install: not the stray one
    (site / "pyproject.toml").write_text("")  # a source tree after all
    assert _library_dir() == site / "templates"


def test_import_does_not_load_torch():
    code = (
        "import sys, forge.config\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
