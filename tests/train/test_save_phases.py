"""A save in two phases (snapshot, commit) and its on-commit step.

A save that fails, or whose process is SIGKILLed, between its snapshot and its commit (or with
the manifest written and the rename not done) changes none of what a committed save changes:
the best checkpoint, rotation (``save_total_limit``), ``run.json`` (kept by the CLI's
``on_save`` callback) and the loop's last checkpoint. Every earlier checkpoint still verifies,
loads and resumes. Faults come from the storage seam's test wrapper (tests/faults).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from forge.checkpoint import (
    CheckpointError,
    CheckpointRegistry,
    CheckpointWriter,
    Component,
    ModelWeights,
    Scope,
    find_checkpoints,
    load_model_weights,
    read_manifest,
    validate_checkpoint,
)
from forge.launch.worker import make_run_record_callback
from forge.runs import RunRecord
from forge.train import TrainerCallback
from forge.train.topology import Topology
from tests.faults import fault_env, inject
from tests.helpers import REPO
from tests.train.common import assert_same_tensors, make_args, make_trainer, tiny_llama_config

SAVE_STEPS, LIMIT, FAULTED = 4, 2, 12  # saves at 4, 8 and 12: the one at 12 faults


class Rounds:
    """``compute_metrics`` giving the evaluation's number: each save is the new best."""

    def __init__(self, first: int = 1) -> None:
        self.count = itertools.count(first)

    def __call__(self, prediction) -> dict[str, float]:
        return {"round": float(next(self.count))}


class KeepsWhatSaveChanged(TrainerCallback):
    """After each committed save: a copy of run.json and of the checkpoints directory's
    listing, and the loop's record of the last and best checkpoints."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: dict[int, dict] = {}

    def on_save(self, args, state, control, checkpoint_path=None, metrics=None, **kwargs):
        seen = {
            "run.json": (self.run_dir / "run.json").read_text(),
            "checkpoints": sorted(p.name for p in (self.run_dir / "checkpoints").iterdir()),
            "loop": (state.last_checkpoint, state.best_checkpoint, state.best_metric),
        }
        self.seen[state.global_step] = seen
        (self.run_dir / f"seen-{state.global_step}.json").write_text(repr(seen))


def trainer_for(run_dir: Path, first_round: int = 1):
    """A trainer saving every 4 steps to ``run_dir`` (whose run.json the CLI's callback keeps),
    each save the new best (evaluation ``first_round`` first), two checkpoints kept."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "run.json").exists():
        RunRecord(run_dir, {"run": 1, "status": "running"}).save()
    args = make_args(
        run_dir,
        max_steps=FAULTED,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        eval_strategy="steps",
        eval_steps=SAVE_STEPS,
        metric_for_best_model="round",
        save_total_limit=LIMIT,
    )
    keeper = KeepsWhatSaveChanged(run_dir)
    callbacks = [make_run_record_callback(RunRecord.load(run_dir)), keeper]
    trainer = make_trainer(
        args, eval_size=8, compute_metrics=Rounds(first_round), callbacks=callbacks
    )
    return trainer, keeper


def train_in_subprocess(run_dir: str) -> None:
    """What the SIGKILL test runs in a child process (its fault comes from the environment)."""
    trainer, _ = trainer_for(Path(run_dir))
    trainer.train()


def assert_nothing_changed(run_dir: Path, before: dict) -> None:
    """run.json, the checkpoints (rotation) and the best are as the step-8 save left them."""
    assert (run_dir / "run.json").read_text() == before["run.json"]
    checkpoints = run_dir / "checkpoints"
    kept = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".tmp-"))
    assert kept == before["checkpoints"] == ["checkpoint-000004", "checkpoint-000008"]
    assert [c.step for c in find_checkpoints(checkpoints)] == [4, 8]
    assert before["loop"][1].endswith("checkpoint-000008")  # the best, as run.json says
    record = RunRecord.load(run_dir).data
    assert record["best"]["checkpoint"] == "checkpoints/checkpoint-000008"
    assert [c["step"] for c in record["checkpoints"]] == [4, 8]
    assert os.readlink(run_dir / "best") == "checkpoints/checkpoint-000008"


def assert_earlier_checkpoints_load(run_dir: Path) -> None:
    """Every earlier checkpoint verifies (hashes) and its weights load; the newest resumes
    to the end, and that save, committed, rotates and becomes the best."""
    checkpoints = run_dir / "checkpoints"
    for step in (4, 8):
        path = checkpoints / f"checkpoint-{step:06d}"
        assert validate_checkpoint(path, verify_hashes=True) == []
        load_model_weights(LlamaForCausalLM(tiny_llama_config()), path, strict=True)
    trainer, keeper = trainer_for(run_dir, first_round=3)  # the evaluations before were 1, 2
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.resumed_from == str(checkpoints / "checkpoint-000008")
    after = keeper.seen[FAULTED]
    assert after["checkpoints"] == ["checkpoint-000008", "checkpoint-000012"]  # rotated
    assert after["loop"][1].endswith("checkpoint-000012")
    assert RunRecord.load(run_dir).data["best"]["checkpoint"] == "checkpoints/checkpoint-000012"


@pytest.mark.parametrize("point", ["start", "before-rename"])
def test_a_save_that_fails_before_its_rename_changes_nothing(tmp_path, monkeypatch, point):
    """``start``: between snapshot and commit; ``before-rename``: every file written."""
    run_dir = tmp_path / "run"
    trainer, keeper = trainer_for(run_dir)
    inject(monkeypatch, fail=f"{point}@{FAULTED}")
    with pytest.raises(CheckpointError, match=f"injected at {point} of step {FAULTED}"):
        trainer.train()
    before = keeper.seen[8]
    assert FAULTED not in keeper.seen  # on_save was not called
    state = trainer.state
    assert (state.last_checkpoint, state.best_checkpoint, state.best_metric) == before["loop"]
    assert_nothing_changed(run_dir, before)
    monkeypatch.undo()
    assert_earlier_checkpoints_load(run_dir)


@pytest.mark.parametrize("point", ["start", "before-rename"])
def test_a_process_killed_before_its_save_is_renamed_changes_nothing(tmp_path, point):
    run_dir = tmp_path / "run"
    code = (
        "import sys; from tests.train.test_save_phases import train_in_subprocess; "
        "train_in_subprocess(sys.argv[1])"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", **fault_env(kill=f"{point}@{FAULTED}"))
    env["PYTHONPATH"] += os.pathsep + str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not (run_dir / f"seen-{FAULTED}.json").exists()  # on_save was not called
    before = eval((run_dir / "seen-8.json").read_text())  # noqa: S307 - the test's own repr
    assert_nothing_changed(run_dir, before)
    temporary = run_dir / "checkpoints" / f".tmp-checkpoint-{FAULTED:06d}"
    assert temporary.exists() == (point == "before-rename")  # "start": nothing written yet
    assert_earlier_checkpoints_load(run_dir)


# ----------------------------------------------------------------- the snapshot is the state


def test_the_weights_written_are_the_snapshot_not_the_live_model(tmp_path):
    """Training that goes on between snapshot and commit changes nothing that is written."""
    model = LlamaForCausalLM(tiny_llama_config())
    moments = {"exp_avg": torch.zeros(3)}

    class Moments:
        def state_dict(self):
            return moments

        def load_state_dict(self, state):
            pass

    registry = CheckpointRegistry(Topology())
    registry.register(Component("model", ModelWeights(model), Scope.STAGE, weights=True))
    registry.register(Component("optimizer", Moments(), Scope.STAGE))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = registry.snapshot(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # the next optimizer steps
    moments["exp_avg"].add_(1.0)
    with CheckpointWriter(tmp_path, 1) as writer:
        snapshot.write(writer)
    fresh = LlamaForCausalLM(tiny_llama_config())
    load_model_weights(fresh, writer.final_path, strict=True)
    assert_same_tensors(expected, fresh.state_dict(), "weights")
    saved = torch.load(writer.final_path / "optimizer.pt", weights_only=True)["state"]
    assert_same_tensors({"exp_avg": torch.zeros(3)}, saved, "optimizer")
    assert read_manifest(writer.final_path).components["model"]["files"]
