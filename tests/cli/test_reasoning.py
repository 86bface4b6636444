"""projects/reasoning through the real entry point: the adaptive-computation model trains,
logs its ponder cost and passes beside the loss, and trains the same with activation
checkpointing on (dropout included); the full run reaches the accuracy its page states."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import REPO, run_forge

SHORT = ["-D", "max_steps=6", "-D", "logging_steps=2", "-D", "eval_steps=6", "-D", "save_steps=6"]
SHORT += ["-D", "num_eval=50", "-D", "report_to=none"]


def copy_project(tmp_path: Path) -> Path:
    project = tmp_path / "reasoning"
    shutil.copytree(
        REPO / "projects" / "reasoning", project, ignore=shutil.ignore_patterns("output")
    )
    return project


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(project: Path, *defines: str) -> tuple[Path, str]:
    result = run_forge("train", "-p", str(project), *defines)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0]), result.stderr


@pytest.mark.slow
def test_a_few_steps_log_the_model_metrics_and_checkpointing_changes_nothing(tmp_path):
    project = copy_project(tmp_path)
    plain, plain_log = train(project, *SHORT)
    wrapped, wrapped_log = train(project, *SHORT, "-D", "activation_checkpointing=true")
    assert "activation checkpointing" not in plain_log
    assert "activation checkpointing: 2 of 2 blocks (blocks.0, blocks.1)" in wrapped_log
    logs = [r for r in records(plain) if "loss" in r and "train_runtime" not in r]
    assert [r["step"] for r in logs] == [2, 4, 6]
    for record in logs:
        assert 1 <= record["mean_steps"] <= 8
        assert record["ponder_cost"] >= record["mean_steps"]
        assert record["task_loss"] < record["loss"]
        assert record["peak_rss_mb"] > 0
    (evaluation,) = [r for r in records(plain) if "eval_accuracy" in r]
    assert 0 <= evaluation["eval_accuracy"] <= evaluation["eval_token_accuracy"] <= 1

    def numbers(run_dir):  # what the training computed; not its time or memory
        keep = ("loss", "task_loss", "ponder_cost", "mean_steps", "grad_norm", "eval_loss")
        return [{k: r[k] for k in keep if k in r} for r in records(run_dir)]

    assert numbers(wrapped) == numbers(plain)  # dropout on: bit-equal with recomputation


@pytest.mark.slow
def test_the_project_learns_to_sort(tmp_path):
    """The default run (600 steps, about a minute on 2 CPU cores) sorts at least 95% of the
    eval sequences exactly (its page says 0.997)."""
    run_dir, _ = train(copy_project(tmp_path), "-D", "report_to=none")
    final = [r for r in records(run_dir) if "eval_accuracy" in r][-1]
    assert final["step"] == 600
    assert final["eval_accuracy"] >= 0.95
