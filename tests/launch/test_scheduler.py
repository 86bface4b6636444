"""The scheduler's warning signal and SLURM's requeue, without a job: names, refusals, which
run a requeued job continues (forge/launch/scheduler.py). The jobs themselves:
tests/reliability/test_preemption.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from forge.launch.errors import LaunchUsageError
from forge.launch.scheduler import check_requeue, requeued_run, use_stop_signal
from forge.lifetime import STOP_SIGNAL_ENV, parse_stop_signal, stop_signals
from forge.runs import create_run
from tests.helpers import run_forge


@pytest.mark.parametrize("name", ["USR1", "SIGUSR1", "usr1", str(int(signal.SIGUSR1))])
def test_a_stop_signal_is_named_as_slurm_and_kill_name_it(name):
    assert parse_stop_signal(name) == signal.SIGUSR1


@pytest.mark.parametrize("name", ["KILL", "SIGSTOP", "CHLD", "NOPE", "0"])
def test_a_signal_that_cannot_ask_for_a_save_is_refused(name, monkeypatch):
    monkeypatch.delenv(STOP_SIGNAL_ENV, raising=False)
    with pytest.raises(LaunchUsageError, match=r"--stop-signal must name a signal .* USR1"):
        use_stop_signal(name)


def test_the_stop_signals_are_sigint_sigterm_and_the_schedulers(monkeypatch):
    monkeypatch.delenv(STOP_SIGNAL_ENV, raising=False)
    assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    use_stop_signal("USR2")  # every process of the job inherits it
    assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
    monkeypatch.setenv(STOP_SIGNAL_ENV, "SIGTERM")
    assert stop_signals() == (signal.SIGINT, signal.SIGTERM)


def test_requeue_needs_a_slurm_job_and_scontrol(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(LaunchUsageError, match="SLURM_JOB_ID is not set"):
        check_requeue(True)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here
    with pytest.raises(LaunchUsageError, match="scontrol is not on PATH"):
        check_requeue(True)
    check_requeue(False)  # without --requeue nothing is asked for


def _run(output: Path, text: str, job: str | None) -> Path:
    fields = {"slurm_job_id": job} if job else {}
    return create_run(
        output / "train", config_name="train", config_text=text, project_root=output,
        overrides=[], variables={}, nproc=1, fields=fields,
    )  # fmt: skip


def test_a_requeued_job_finds_the_run_it_started_and_no_other(monkeypatch, tmp_path):
    mine = _run(tmp_path, "a: 1\n", "42")
    _run(tmp_path, "a: 2\n", "42")  # the same job trained another config after it
    _run(tmp_path, "a: 1\n", "41")  # another job
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert requeued_run(tmp_path, "train", "a: 1\n") is None  # not requeued: a new run
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert requeued_run(tmp_path, "train", "a: 1\n") == mine
    assert requeued_run(tmp_path, "train", "a: 3\n") is None
    monkeypatch.setenv("SLURM_JOB_ID", "43")
    assert requeued_run(tmp_path, "train", "a: 1\n") is None


def test_forge_train_refuses_requeue_outside_slurm_before_anything_starts(tmp_path):
    env = {"SLURM_JOB_ID": ""}
    result = run_forge("train", "-p", str(tmp_path), "--requeue", env=env)
    assert result.returncode == 2, result.stderr
    assert "error: --requeue requeues a SLURM job, and SLURM_JOB_ID is not set" in result.stderr
    result = run_forge("train", "-p", str(tmp_path), "--stop-signal", "KILL")
    assert result.returncode == 2 and "--stop-signal must name a signal" in result.stderr
    assert "Traceback" not in result.stderr
