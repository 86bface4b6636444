"""A resume that fails before its first step trains nothing, so the run stays what it was: a
completed run is still completed, an interrupted one still interrupted, its config without the
resume's --set; run.json records the failed attempt beside the status, and the command's exit
code is the failure's."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_forge
from tests.plain_project import train_in_process, write_project

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("nproc", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_a_resume_that_fails_to_start_leaves_the_run_as_it_was(tmp_path, nproc):
    root = write_project(tmp_path / "plain")
    run_dir = train_in_process(root, "lm")
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["step"] == 4
    config = (run_dir / "config.yaml").read_text()
    # another model width: the checkpoint's weights cannot load, before any step is trained
    result = run_forge(
        "resume", "-p", str(root), "--nproc", nproc,
        "--set", "model.hidden=32", "--set", "trainer.args.max_steps=8",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "weights do not fit model.py:TinyLM" in result.stderr
    after = json.loads((run_dir / "run.json").read_text())
    assert after["status"] == "completed" and after["step"] == 4
    assert "weights do not fit model.py:TinyLM" in after["failed_resume"]["error"]
    assert after["failed_resume"]["kind"] == "runtime"
    assert (run_dir / "config.yaml").read_text() == config  # its --set undone
    again = run_forge("resume", "-p", str(root), "--set", "trainer.args.max_steps=8")
    assert again.returncode == 0, again.stderr  # the run itself is fine
    assert json.loads((run_dir / "run.json").read_text())["step"] == 8
