"""A missing optional package is named with the pip command that installs it, wherever it
surfaces: a config node, a project file, a build, the integrations."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from forge.config import load_config, load_project
from forge.extras import OPTIONAL_PACKAGES, install_command
from tests.helpers import REPO, run_forge

DATASETS_COMMAND = "pip install 'forge[datasets]'"


@pytest.fixture
def no_datasets(monkeypatch) -> None:
    """`import datasets` fails in this process as it does where datasets is not installed."""
    monkeypatch.setitem(sys.modules, "datasets", None)


def blank_project(tmp_path: Path, data_py: str, dataset_yaml: str) -> Path:
    """A project as `forge new NAME --from blank` writes it, with a model and a dataset."""
    from forge.cli.new import new_project

    project = new_project("proj", tmp_path, "blank")
    (project / "data.py").write_text(data_py)
    config = project / "templates" / "configs" / "train.yaml"
    text = config.read_text()
    text = text.replace(
        "train_dataset: &train_dataset null", f"train_dataset: &train_dataset {dataset_yaml}"
    )
    text = text.replace(
        "model: &model null",
        "model: &model !partial:torch.nn:Linear {in_features: 2, out_features: 2}",
    )
    config.write_text(text)
    return project


def check(project: Path) -> str:
    cfg = load_config(load_project(project), "train.yaml")
    return "\n".join(str(problem) for problem in cfg.check())


def test_a_config_node_of_a_missing_extra_names_its_pip_command_at_the_template_line(
    tmp_path, no_datasets
):
    project = blank_project(
        tmp_path, "", "!singleton:datasets:load_dataset {path: json, data_files: rows.json}"
    )
    problems = check(project)
    line = next(
        n
        for n, text in enumerate(
            (project / "templates/configs/train.yaml").read_text().splitlines(), 1
        )
        if "datasets:load_dataset" in text
    )
    assert f"train.yaml:{line}: train_dataset: no module named 'datasets'" in problems
    assert DATASETS_COMMAND in problems


def test_a_project_file_that_imports_a_missing_extra_names_the_line_and_the_command(
    tmp_path, no_datasets
):
    project = blank_project(
        tmp_path,
        '"""Data."""\nimport datasets\n\n\nclass Rows:\n    pass\n',
        "!singleton:./data.py:Rows []",
    )
    problems = check(project)
    assert "loading ./data.py:2 failed: ModuleNotFoundError" in problems
    assert DATASETS_COMMAND in problems


@pytest.mark.integration
def test_an_import_of_a_missing_extra_while_the_config_builds_says_what_to_install(tmp_path):
    blocker = tmp_path / "blocker" / "datasets"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')\n"
    )
    project = blank_project(
        tmp_path,
        "def rows():\n    import datasets\n\n    return datasets.Dataset.from_list([])\n",
        "!singleton:./data.py:rows []",
    )
    env = {"PYTHONPATH": f"{blocker.parent}:{REPO}"}
    result = run_forge("train", "-p", str(project), "--dry-run", env=env)
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr and DATASETS_COMMAND in result.stderr
    assert "while building train_dataset" in result.stderr


def test_every_extra_of_forge_has_its_install_command():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    user_extras = {name: reqs for name, reqs in extras.items() if name not in ("dev", "mutation")}
    assert user_extras, "pyproject.toml lists no extras"
    for extra, requirements in user_extras.items():
        for requirement in requirements:
            package = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
            assert install_command(package) == f"pip install 'forge[{extra}]'", (extra, package)
    # the integrations' packages are named too (report_to), by submodule as well
    assert install_command("wandb.sdk") == OPTIONAL_PACKAGES["wandb"] == "pip install wandb"
    assert install_command("torch") is None
