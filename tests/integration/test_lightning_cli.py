"""A LightningModule trained through LightningAdapter by `forge train --nproc 2` (DDP on two
processes) and resumed by `forge resume --nproc 2`, bit for bit: the project is
docs/models-and-data.md's ("A LightningModule"), its 2-process command the page's.

Each rank sees 2 batches an epoch; the run stopped at step 3 (inside the second epoch, its
``on_epoch`` sums half made, the epoch schedule not yet stepped) and resumed to step 8 ends with
the weights, optimizer, schedule and each rank's epoch progress of the run trained straight to
8, and logs the same epoch means and validation metrics after the resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests import docs
from tests.cli.test_readme import lightning_project
from tests.helpers import run_forge
from tests.train.common import assert_same_tensors, component_state
from tests.train.lightning_common import NEEDS_LIGHTNING

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TWO_PROCESSES = [c for c in docs.commands("forge train lightning") if "--nproc" in c]


def train(root: Path, *settings: str) -> Path:
    (command,) = TWO_PROCESSES
    command = [a if a != "max_steps=8" else settings[0] for a in command]
    result = run_forge(*command, *settings[1:], cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr
    return root / result.stdout.splitlines()[0]


def final(run_dir: Path, step: int = 8) -> dict:
    checkpoint = run_dir / "checkpoints" / f"checkpoint-{step:06d}"
    return {
        "model": load_file(checkpoint / "model.safetensors"),
        "optimizer": component_state(checkpoint, "optimizer"),
        "lr_scheduler": component_state(checkpoint, "lr_scheduler"),
        **{f"lightning{r}": component_state(checkpoint, "lightning", rank=r) for r in (0, 1)},
    }


def after_step(run_dir: Path, step: int) -> list[dict]:
    keys = ("loss", "train_loss_step", "train_loss_epoch", "learning_rate", "eval_val_acc")
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [
        {k: r[k] for k in ("step", *keys) if k in r}
        for r in records
        if r["step"] > step and "train_runtime" not in r
    ]


def test_a_lightning_module_trains_and_resumes_on_two_processes(tmp_path):
    pytest.importorskip("lightning", reason=NEEDS_LIGHTNING)
    name = lightning_project(tmp_path)
    straight = train(tmp_path, "max_steps=8", "-D", "save_steps=3")
    stopped = train(tmp_path, "max_steps=3", "-D", "save_steps=3")
    resumed = run_forge(
        "resume", "-p", name, "--run-dir", str(stopped), "--set", "trainer.args.max_steps=8",
        "--nproc", "2", cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from " in resumed.stderr and "checkpoint-000003 at step 3" in resumed.stderr
    a, b = final(straight), final(stopped)
    assert a.keys() == b.keys()
    for key in a:
        assert_same_tensors(a[key], b[key], key)
    assert a["lightning0"]["epoch"] == 3 and a["lightning0"]["batches"] == 2  # 2 a rank an epoch
    logs = after_step(straight, 3)
    assert logs == after_step(stopped, 3)
    assert [r["step"] for r in logs if "train_loss_epoch" in r] == [4, 6, 8]
    assert [r["step"] for r in logs if "eval_val_acc" in r] == [4, 6, 8]
