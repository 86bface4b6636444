"""`forge vars`, `forge render --resolved` and `forge ls -D` through the real entry point."""

from __future__ import annotations

import re

from tests.helpers import TINY_LM, run_forge

TRAIN = "projects/tiny_lm/templates/configs/train.yaml"


def max_steps_line() -> int:
    lines = (TINY_LM / "templates" / "configs" / "train.yaml").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip().startswith("max_steps:"))


def test_vars_prints_a_table_of_values_defaults_and_lines():
    result = run_forge("vars", "train", "-p", str(TINY_LM), "-D", "max_steps=7")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["VARIABLE", "VALUE", "DEFAULT", "WHERE"]
    assert ["max_steps", "7", "-D"] in rows
    assert ["max_steps", "500", f"{TRAIN}:{max_steps_line()}"] in rows
    assert any(
        row[:2] == ["max_steps", "-1"] and row[2].startswith("templates/base.yaml:") for row in rows
    )
    assert any(row[:2] == ["vocab_size", "4096"] for row in rows)
    assert any(row[:2] == ["project_name", "tiny_lm"] and row[-1] == "forge" for row in rows)


def test_vars_refuses_an_unread_define():
    result = run_forge("vars", "train", "-p", str(TINY_LM), "-D", "max_step=7")
    assert result.returncode == 2
    assert "did you mean 'max_steps'" in result.stderr


def test_vars_refuses_a_set_it_would_ignore():
    result = run_forge("vars", "train", "-p", str(TINY_LM), "--set", "trainer.args.max_steps=3")
    assert result.returncode == 2
    assert "--set acts on the rendered YAML" in result.stderr
    assert "forge render CONFIG --resolved --set" in result.stderr
    assert result.stdout == ""


def test_render_resolved_shows_each_key_once_with_its_line():
    result = run_forge("render", "train", "-p", str(TINY_LM), "--resolved")
    assert result.returncode == 0, result.stderr
    assert f"  max_steps: 500  # {TRAIN}:{max_steps_line()}" in result.stdout
    assert result.stdout.count("max_steps:") == 1
    assert re.search(r"^  seed: 42  # templates/base\.yaml:\d+$", result.stdout, re.M)


def test_ls_define_needs_one_config_to_read_it(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: two\n")
    (tmp_path / "templates" / "configs" / "a.yaml").write_text("a: {{ width | default(1) }}\n")
    (tmp_path / "templates" / "configs" / "b.yaml").write_text("b: 2\n")
    ok = run_forge("ls", "--no-check", "-D", "width=3", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    typo = run_forge("ls", "--no-check", "-D", "widht=3", cwd=tmp_path)
    assert typo.returncode == 2
    assert "-D widht: no config of this project reads a variable 'widht'" in typo.stderr
    assert "did you mean 'width'?" in typo.stderr


def readme_output(command: str) -> list[str]:
    from tests import docs

    return [line.split() for line in docs.output(command).splitlines() if line != "..."]


def test_readme_vars_and_resolved_outputs_are_true():
    for command in (
        "forge vars train -p projects/tiny_lm -D max_steps=50",
        "forge render train -p projects/tiny_lm --resolved",
    ):
        result = run_forge(*command.split()[1:], cwd=TINY_LM.parents[1])
        assert result.returncode == 0, result.stderr
        real = [line.split() for line in result.stdout.splitlines()]
        for line in readme_output(command):
            assert line in real, line
