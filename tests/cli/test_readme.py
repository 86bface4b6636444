"""The README's examples stay true: its broken config reports exactly the errors it shows."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest

from tests.helpers import REPO, run_forge

README = (REPO / "README.md").read_text()


def readme_block(marker: str) -> str:
    match = re.search(r"```yaml\n" + re.escape(marker) + r"\n(.*?)```", README, re.S)
    assert match, f"README has no yaml block starting with {marker!r}"
    return match.group(1)


def test_readme_broken_config_reports_its_three_problems(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: bad\n")
    broken = readme_block("# templates/configs/broken.yaml")
    (tmp_path / "templates" / "configs" / "broken.yaml").write_text(broken)
    result = run_forge("train", "broken", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    shown = re.search(r"\$ forge train broken --dry-run\n(.*?)```", README, re.S).group(1)
    for line in shown.splitlines():
        if line.startswith("templates/"):
            located = line.split(" (valid:")[0]
            assert located in result.stderr, located


def test_readme_tiny_lm_config_is_the_shipped_one():
    shipped = (REPO / "projects/tiny_lm/templates/configs/train.yaml").read_text().rstrip()
    assert shipped in README


def readme_commands(first: str) -> list[list[str]]:
    """The `forge ...` lines of the README's bash block whose first line starts with ``first``."""
    match = re.search(r"```bash\n(" + re.escape(first) + r".*?)```", README, re.S)
    assert match, f"README has no bash block starting with {first!r}"
    lines = [line.split("  #")[0].strip() for line in match.group(1).splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("forge ")]


def test_readme_new_project_example_runs(tmp_path):
    commands = readme_commands("forge new demo_cls")
    assert len(commands) == 4
    for command in commands:
        result = run_forge(*command, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
    assert (tmp_path / "demo_cls" / "output" / "wide" / "run_001" / "checkpoints").is_dir()


def test_readme_text_cls_config_is_the_shipped_one():
    shipped = (REPO / "projects/text_cls/templates/configs/train.yaml").read_text().rstrip()
    assert shipped in README


@pytest.mark.slow
def test_readme_text_cls_commands_run(tmp_path):
    """Train text_cls as the README does, then evaluate, predict and generate from it."""
    pytest.importorskip("datasets")
    project = tmp_path / "projects" / "text_cls"
    shutil.copytree(
        REPO / "projects" / "text_cls", project, ignore=shutil.ignore_patterns("output")
    )
    (tmp_path / "reviews.jsonl").write_text('{"text": "the acting was superb"}\n')
    train, evaluate, predict, generate = readme_commands("forge train -p projects/text_cls")
    assert run_forge(*train, cwd=tmp_path).returncode == 0
    result = run_forge(*evaluate, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    accuracy = float(result.stdout.split("eval_accuracy")[1].split()[0])
    assert accuracy > 0.85  # the README says it climbs to about 0.95
    assert run_forge(*predict, cwd=tmp_path).returncode == 0
    assert '"prediction": "positive"' in (tmp_path / "labelled.jsonl").read_text()
    refused = run_forge(*generate, cwd=tmp_path)
    assert refused.returncode == 2
    assert "holds a BertForSequenceClassification" in refused.stderr
