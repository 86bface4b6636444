"""Evaluation on 2 ranks (torchrun, gloo) gives what one process gives: every row once, in
dataset order, the same per-sample loss, the same means of the model's scalar outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.train.ddp_eval_script import EVAL_SIZE, with_label_mean
from tests.train.test_evaluation import classifier, forge_classifier_trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("ddp_eval_script.py")


def test_two_ranks_gather_every_prediction_in_order(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(SCRIPT), str(tmp_path / "ddp"),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    ddp = json.loads((tmp_path / "ddp" / "eval.json").read_text())

    seen = {}

    def record(eval_pred):
        seen["predictions"], seen["labels"] = eval_pred.predictions, eval_pred.label_ids
        return {"rows": len(eval_pred.label_ids)}

    trainer = forge_classifier_trainer(
        tmp_path / "one",
        with_label_mean(classifier()),
        eval_size=EVAL_SIZE,
        per_device_eval_batch_size=4,
    )
    trainer.compute_metrics = record
    one = trainer.evaluate()
    assert ddp["metrics"]["eval_rows"] == one["eval_rows"] == EVAL_SIZE  # no row twice
    assert ddp["labels"] == seen["labels"].tolist()  # dataset order
    np.testing.assert_allclose(ddp["predictions"], seen["predictions"], atol=1e-5)
    assert abs(ddp["metrics"]["eval_loss"] - one["eval_loss"]) < 1e-6
    # a scalar output: its mean over the 21 rows, on one process as on two
    label_mean = float(np.mean(seen["labels"]))
    assert one["eval_label_mean"] == pytest.approx(label_mean, abs=1e-6)  # float32 means
    assert ddp["metrics"]["eval_label_mean"] == pytest.approx(label_mean, abs=1e-6)
