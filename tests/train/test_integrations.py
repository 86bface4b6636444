"""report_to wandb / mlflow: offline runs under the run directory that a resume continues.

Each test runs only where its package is installed (neither is a forge dependency); the
message for a missing one is tested in test_args.py."""

from __future__ import annotations

import os

import pytest

from tests.train.common import make_args, make_trainer


def train_and_resume(output_dir, report_to):
    for max_steps, resume in ((4, False), (6, True)):
        args = make_args(
            output_dir,
            max_steps=max_steps,
            logging_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            report_to=report_to,
        )
        make_trainer(args, eval_size=8).train(resume_from_checkpoint=resume)


def test_mlflow_logs_every_metric_into_one_run_across_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    train_and_resume(tmp_path, "mlflow")
    from forge.train.integrations import local_tracking_uri

    client = MlflowClient(tracking_uri=local_tracking_uri(tmp_path))
    run_id = (tmp_path / "mlflow_run_id").read_text()
    history = client.get_metric_history(run_id, "eval_loss")
    assert [m.step for m in history] == [2, 4, 6]  # the resumed steps went to the same run
    run = client.get_run(run_id)
    assert {"loss", "learning_rate", "eval_loss"} <= set(run.data.metrics)
    assert run.data.params["max_steps"] == "4"


def test_wandb_runs_offline_under_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train_and_resume(tmp_path, "wandb")
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({name.rsplit("-", 1)[1] for name in runs}) == 1  # one run id
    assert not os.environ.get("WANDB_MODE")  # offline by argument, not by changing the env
