"""The README's examples stay true: its broken config reports exactly the errors it shows."""

from __future__ import annotations

import re

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
