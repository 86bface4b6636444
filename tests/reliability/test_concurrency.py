"""Two commands on one project at once: distinct runs, caches built once, and no run trained
by two jobs (the run lock; forge/runs.py)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from forge.checkpoint import find_latest_checkpoint, parse_checkpoint_step
from tests.helpers import REPO, TINY_LM, run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import start_forge, wait_for

pytestmark = pytest.mark.integration


def test_two_trains_at_once_get_two_runs_and_build_each_cache_once(tmp_path):
    project = tmp_path / "tiny_lm"
    shutil.copytree(TINY_LM, project, ignore=shutil.ignore_patterns("output"))
    args = ("train", "-p", str(project), *SMALL, "-D", "max_steps=2", "-D", "save_steps=1")
    procs = [start_forge(*args, cwd=REPO) for _ in range(2)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
    runs = sorted(Path(stdout.splitlines()[0]).name for stdout, _ in outputs)
    assert runs == ["run_001", "run_002"]
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("BPE tokenizer on") == 1, stderr  # trained by one, loaded by the other
    caches = sorted(p.name for p in (project / "output").glob("tokens-*.npy"))
    assert len(caches) == 2  # the train and eval splits
    for cache in caches:
        assert stderr.count(cache) == 1, (cache, stderr)  # tokenized by one process only
    for run in runs:
        record = json.loads((project / "output" / "train" / run / "run.json").read_text())
        assert record["status"] == "completed" and record["step"] == 2


def test_resume_of_a_live_run_is_refused_and_of_a_killed_one_continues(project):
    train = start_forge("train", "-p", str(project), *SMALL, "-D", "max_steps=400", cwd=REPO)
    run_dir = Path(train.stdout.readline().strip())
    try:
        wait_for(run_dir / "checkpoints" / "checkpoint-000010", train)
        before = (run_dir / "run.json").read_text()
        refused = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
        assert refused.returncode == 1, refused.stderr
        assert f"run_001 is being trained right now (pid {train.pid} on " in refused.stderr
        assert "Traceback" not in refused.stderr and refused.stdout == ""
        assert json.loads((run_dir / "run.json").read_text())["resumes"] == []
        assert json.loads(before)["status"] == "running"
    finally:
        train.send_signal(signal.SIGKILL)
        train.wait()

    listed = run_forge("runs", "-p", str(project))
    assert listed.returncode == 0, listed.stderr
    assert "killed" in listed.stdout.splitlines()[1]  # run.json says running; nothing holds it
    newest = find_latest_checkpoint(run_dir / "checkpoints")
    longer = f"trainer.args.max_steps={parse_checkpoint_step(newest) + 2}"
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), "--set", longer)
    assert resumed.returncode == 0, resumed.stderr
    assert "run_001 was left 'running' by a process that is gone (pid " in resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
