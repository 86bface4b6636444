"""Reporting callbacks, rank-0 outputs and signal handling."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import sys

import pytest

from forge.train import TrainingInterrupted
from forge.train.signals import StopSignals
from tests.train.common import SignalAtStep, checkpoint_dir, make_args, make_trainer


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_records(records):
    """The records of steps and evaluations, without the end-of-training summaries."""
    return [r for r in records if "train_runtime" not in r]


def jsonl_args(output_dir, **overrides):
    values = dict(
        max_steps=12,
        logging_steps=4,
        eval_strategy="steps",
        eval_steps=6,
        save_strategy="steps",
        save_steps=6,
        report_to="tensorboard",
    )
    values.update(overrides)
    return make_args(output_dir, **values)


def test_metrics_jsonl_has_one_object_per_log_and_eval(tmp_path):
    make_trainer(jsonl_args(tmp_path), eval_size=8).train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    logs = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in logs] == [4, 8, 12]
    assert [r["step"] for r in evals] == [6, 12]
    for record in logs:
        assert {"loss", "learning_rate", "grad_norm", "tokens_per_second", "epoch"} <= set(record)
        assert record["tokens_per_second"] > 0
    assert logs[-1]["learning_rate"] == 0.0  # linear decay to zero at max_steps
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_metrics_jsonl_is_rewritten_consistently_on_resume(tmp_path):
    make_trainer(jsonl_args(tmp_path), eval_size=8).train()
    before = step_records(read_jsonl(tmp_path / "metrics.jsonl"))
    resumed = make_trainer(jsonl_args(tmp_path), eval_size=8)
    resumed.train(resume_from_checkpoint=str(checkpoint_dir(tmp_path, 6)))
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert "train_runtime" in records[-1]  # the resumed call's summary; the first's is gone
    after = step_records(records)
    steps = [(r["step"], "eval_loss" in r) for r in after]
    assert steps == [(4, False), (6, True), (8, False), (12, False), (12, True)]
    assert after[:2] == before[:2]  # history up to the checkpoint is kept as it was
    # exact resume: the same losses again after step 6
    assert [r.get("loss") for r in after[2:]] == [r.get("loss") for r in before[2:]]


def test_progress_logs_plain_lines_without_a_tty(tmp_path, caplog):
    args = make_args(tmp_path, max_steps=4, logging_steps=2, report_to="none")  # the console stays
    with caplog.at_level(logging.INFO, logger="forge.train"):
        make_trainer(args).train()
    lines = [r.getMessage() for r in caplog.records if r.name == "forge.train.callbacks"]
    assert lines.pop().startswith("trained to step 4 | train_runtime ")  # the summary
    assert len(lines) == 2
    assert lines[0].startswith("step 2/4 | loss ")
    assert "learning_rate" in lines[0] and "tokens_per_second" in lines[0]


def test_sigint_saves_a_checkpoint_and_raises_with_its_signal(tmp_path):
    trainer = make_trainer(
        make_args(tmp_path, max_steps=10), callbacks=[SignalAtStep(3, signal.SIGINT)]
    )
    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.train()
    assert info.value.signum == signal.SIGINT
    assert info.value.checkpoint == str(checkpoint_dir(tmp_path, 3))
    assert (checkpoint_dir(tmp_path, 3) / "manifest.json").is_file()
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_second_signal_raises_keyboard_interrupt_at_once():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.received == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_training_interrupted_message_and_pickling():
    import pickle

    error = TrainingInterrupted(signal.SIGTERM, 20, "/run/checkpoints/checkpoint-000020")
    assert "SIGTERM at step 20" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert again.signum == signal.SIGTERM and again.step == 20


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal(tmp_path, monkeypatch, caplog):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    args = make_args(tmp_path, max_steps=4, logging_steps=2, report_to="none")  # the console stays
    trainer = make_trainer(args)
    with caplog.at_level(logging.INFO, logger="forge.train.callbacks"):
        trainer.train()
    text = terminal.getvalue()
    assert "train" in text and "4/4" in text
    assert "loss=" in text and "tok/s=" in text
    assert not [r for r in caplog.records if r.name == "forge.train.callbacks"]  # no plain lines
    progress = next(cb for cb in trainer.callback_handler.callbacks if hasattr(cb, "bar"))
    assert progress.bar is None  # closed at the end


def test_a_callback_that_asks_on_evaluation_gets_a_checkpoint_at_that_step_and_stops(tmp_path):
    """What a sweep's pruning does: save where the evaluation said stop, though no save is due."""
    from forge.train import TrainerCallback

    class StopHere(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics, **kwargs):
            if state.global_step == 4:
                control.should_save = True
                control.should_training_stop = True

    args = jsonl_args(tmp_path, eval_steps=4, save_steps=10, max_steps=12)
    args.save_final_checkpoint = False  # the save asked for is the only one
    trainer = make_trainer(args, eval_size=8)
    trainer.add_callback(StopHere())
    trainer.train()
    assert trainer.state.global_step == 4
    assert checkpoint_dir(tmp_path, 4).is_dir()
