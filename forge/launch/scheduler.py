"""A scheduler's warning before its time limit: save, stop, and (under SLURM) requeue the job.

A cluster sends a signal ahead of a job's time limit (SLURM: ``sbatch --signal=USR1@90`` sends
SIGUSR1 90 s before). Every process of a forge job takes it as it takes SIGTERM: the ranks agree
on a step, save a checkpoint of it and stop, and the run is marked ``interrupted``
(forge.lifetime names the signal, ``--stop-signal`` another one). With ``--requeue`` the launching
``forge`` then asks SLURM to requeue the job (``scontrol requeue $SLURM_JOB_ID``). The requeued job
runs its batch script again, with the same ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT`` > 0: its
``forge train`` finds the run that job started (``slurm_job_id`` in ``run.json``, the same
rendered config) and resumes it instead of starting a new run.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from forge.launch.errors import LaunchUsageError
from forge.lifetime import STOP_SIGNAL_ENV, parse_stop_signal, scheduler_signal, stop_signals
from forge.runs import RunError, RunRecord, config_output_dir, list_run_dirs, now_iso

logger = logging.getLogger(__name__)

JOB_ID_ENV = "SLURM_JOB_ID"
RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"  # SLURM sets it in a requeued job (1, 2, ...)
RECORD_KEY = "slurm_job_id"


def use_stop_signal(value: str | None) -> None:
    """``--stop-signal``: the signal every process of the job saves and stops on besides
    SIGTERM and Ctrl-C (they inherit ``FORGE_STOP_SIGNAL``); a bad name is a usage error."""
    if value is None:
        return
    try:
        signum = parse_stop_signal(value)
    except ValueError as err:
        raise LaunchUsageError(str(err)) from None
    os.environ[STOP_SIGNAL_ENV] = signum.name


def stopped_codes() -> set[int]:
    """The exit codes of a job that a stop signal ended (130, 143, and the scheduler's)."""
    return {128 + int(signum) for signum in stop_signals()}


def check_requeue(requeue: bool) -> None:
    """``--requeue`` needs a SLURM job to requeue and ``scontrol`` to do it: refused before
    anything starts otherwise."""
    if not requeue:
        return
    if not os.environ.get(JOB_ID_ENV):
        raise LaunchUsageError(
            f"--requeue requeues a SLURM job, and {JOB_ID_ENV} is not set: run forge inside an "
            "sbatch job, or drop --requeue"
        )
    if shutil.which("scontrol") is None:
        raise LaunchUsageError("--requeue runs `scontrol requeue`, and scontrol is not on PATH")


def job_fields() -> dict[str, Any]:
    """What ``run.json`` records of the SLURM job that created the run."""
    job = os.environ.get(JOB_ID_ENV)
    return {RECORD_KEY: job} if job else {}


def requeued_run(output_root: Path, config_name: str, config_text: str) -> Path | None:
    """In a job SLURM requeued, the run it started before: the newest run of ``config_name``
    that records this job id and has the same rendered config. None elsewhere."""
    job = os.environ.get(JOB_ID_ENV)
    try:
        restarted = int(os.environ.get(RESTART_COUNT_ENV, "0")) > 0
    except ValueError:
        restarted = False
    if not job or not restarted:
        return None
    for run_dir in reversed(list_run_dirs(config_output_dir(output_root, config_name))):
        try:
            data = RunRecord.load(run_dir).data
            same = (run_dir / "config.yaml").read_text() == config_text
        except (RunError, OSError):
            continue
        if data.get(RECORD_KEY) == job and same:
            return run_dir
    return None


def requeue_after_stop(run_dir: Path, code: int, requeue: bool) -> int:
    """After the job ended with ``code``: if ``--requeue`` was given and the scheduler's signal
    stopped it (the run saved and is ``interrupted``), requeue the SLURM job and record it.
    Returns the exit code: ``code``, or 1 when ``scontrol`` failed."""
    warning = scheduler_signal()
    if not requeue or code != 128 + int(warning):
        return code
    record = RunRecord.load(run_dir)
    if record.data.get("status") != "interrupted" or record.data.get("signal") != warning.name:
        return code
    job = os.environ[JOB_ID_ENV]
    command = ["scontrol", "requeue", job]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        failure = (done.stderr.strip() or f"exit code {done.returncode}") if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = str(err)
    if failure:
        logger.error(
            "could not requeue SLURM job %s (%s): %s; the run is saved: resubmit the job, or "
            "continue it with `forge resume --run-dir %s`",
            job,
            " ".join(command),
            failure,
            run_dir,
        )
        return 1
    requeues = [*record.data.get("requeues", []), {"at": now_iso(), "job": job}]
    record.update(requeues=requeues)
    logger.info(
        "requeued SLURM job %s (stopped by %s): the requeued job continues %s",
        job,
        warning.name,
        run_dir.name,
    )
    return code
