"""A stream run with loader workers ends: the job exits once its last step is saved (the default
suite's representative of test_stream_resume.py, whose cases are slow).

Found as a hang: a rank trained to max_steps, wrote its summary and never exited, because the
stream's loader workers (which ignore the stop signals, so that a scheduler's signal cannot
kill them before their rank saves) were still alive when Python's exit waited for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_forge
from tests.integration.test_stream_resume import project  # noqa: F401 (the scaffold's fixture)

pytestmark = pytest.mark.integration


def test_a_stream_run_with_loader_workers_exits_after_its_last_step(project):  # noqa: F811
    result = run_forge(
        "train", "stream", "-p", str(project), "-D", "source=plain", "-D", "workers=2",
        "--set", "trainer.args.max_steps=6", "--set", "trainer.args.save_steps=6",
        timeout=240,  # run_forge fails naming the command if it does not exit by then
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = Path(result.stdout.splitlines()[0])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    assert (run_dir / "checkpoints" / "checkpoint-000006" / "model.safetensors").is_file()
