"""Running a sweep's trials: each one a training process of an ordinary run, N at once.

A worker (one of ``--jobs`` threads, or a process of its own: a SLURM array task, a second
``forge sweep``) loops: under the sweep's lock pick the next trial (an interrupted one first,
resumed from its run's newest checkpoint, else a new one), train it in a process of its own
that dies with the sweep (forked from a parent that imported torch once:
forge.sweep.trial_process), read its objective from the run's ``metrics.jsonl`` and record the
trial. Nothing here imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.runs import (
    RunBusyError,
    RunError,
    RunLock,
    RunRecord,
    claim_run,
    now_iso,
    run_is_live,
)
from forge.sweep.space import SweepUsageError
from forge.sweep.study import ENDED, Sweep, load_study, tell
from forge.sweep.trial_process import TrialProcess

logger = logging.getLogger(__name__)

MakeRun = Callable[[dict[str, Any], dict[str, Any]], Path]


@dataclass
class Job:
    """A trial a worker has claimed: its record, its run, the run's launch lock."""

    record: dict[str, Any]
    run_dir: Path
    lock: RunLock
    resume: bool


class Sweeper:
    """The workers of one ``forge sweep`` process over one sweep."""

    def __init__(
        self,
        sweep: Sweep,
        project_root: Path,
        make_run: MakeRun,
        *,
        jobs: int = 1,
        max_trials_here: int | None = None,
        allow: list[str] = (),
    ) -> None:
        self.sweep = sweep
        self.project_root = project_root
        self.make_run = make_run
        self.jobs = jobs
        self.max_trials_here = max_trials_here
        self.allow = list(allow)
        self.study = load_study(sweep) if sweep.spec.uses_optuna else None
        self.stopping: int | None = None  # the signal that stops the sweep
        self.missing_metric: str | None = None
        self._children: set[TrialProcess] = set()
        self._mutex = threading.Lock()
        self._started_here = 0
        self.errors: list[BaseException] = []  # a worker thread's own failure, raised by run()
        self.trained_here: list[dict[str, Any]] = []  # the records of the trials trained here

    # ------------------------------------------------------------------ picking a trial

    def next_job(self) -> Job | None:
        """Under the sweep's lock: an interrupted trial to resume, else a new one, else None."""
        sweep = self.sweep
        with sweep.locked():
            records = sweep.records()
            if self.study is not None:
                records = self._adopt_asked(records)
            if not self._may_take_another():
                return None
            for record in records:
                if record["status"] in ENDED:
                    continue
                job = self._reclaim(record)
                if job is not None:
                    self._started_here += 1
                    return job
            if len(records) >= sweep.trials or self.stopping or self.missing_metric:
                return None
            self._started_here += 1
            return self._new_trial(len(records))

    def _may_take_another(self) -> bool:
        """``--one-trial`` (a SLURM array task) takes one trial, resumed or new; else any."""
        return self.max_trials_here is None or self._started_here < self.max_trials_here

    def _adopt_asked(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A study trial asked by a sweep killed before it wrote the trial's record gets one."""
        known = {r["trial"] for r in records}
        for trial in self.study.get_trials(deepcopy=False):
            if trial.number not in known and not trial.state.is_finished():
                record = self._record(trial.number, dict(trial.params), trial._trial_id)
                self.sweep.write(record)
                records.append(record)
        return sorted(records, key=lambda r: r["trial"])

    def _record(self, number: int, values: dict[str, Any], trial_id: int | None) -> dict:
        return {
            "trial": number,
            "params": values,
            "trial_id": trial_id,
            "run_dir": None,
            "status": "running",
            "value": None,
            "created": now_iso(),
        }

    def _new_trial(self, number: int) -> Job:
        if self.study is not None:
            from forge.sweep.study import ask

            trial = ask(self.study, self.sweep.spec)
            record = self._record(trial.number, dict(trial.params), trial._trial_id)
        else:
            record = self._record(number, self.sweep.spec.trial_values(number), None)
        self.sweep.write(record)  # the number is this worker's from here on
        return self._start(record)

    def _start(self, record: dict[str, Any]) -> Job:
        field = self.sweep.sweep_field(record["trial"], record["params"], record["trial_id"])
        run_dir = self.make_run(record["params"], field)
        lock = claim_run(run_dir)
        record["run_dir"] = str(run_dir)
        self.sweep.write(record)
        return Job(record, run_dir, lock, resume=False)

    def _reclaim(self, record: dict[str, Any]) -> Job | None:
        """A trial left running: nobody's (resume it) or a live worker's (None)."""
        if record.get("run_dir") is None:
            found = _run_of_trial(self.sweep, record["trial"])
            if found is None:
                return self._start(record)
            record["run_dir"] = str(found)
        run_dir = Path(record["run_dir"])
        if run_is_live(run_dir):  # a live worker's: no wait for its lock under the sweep's
            return None
        try:
            lock = claim_run(run_dir)
        except RunBusyError:
            return None
        except RunError:
            return None
        job = Job(record, run_dir, lock, resume=True)
        status = _run_status(run_dir)
        if status in ENDED:  # it ended, and its sweep died before recording it
            self._settle(job)
            lock.release()
            return None
        logger.info("trial %d: resuming %s (its sweep was stopped)", record["trial"], run_dir)
        return job

    # ------------------------------------------------------------------ running a trial

    def run(self) -> int:
        """Run trials until the budget is spent (or a signal stops the sweep); the exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            threads = [
                threading.Thread(target=self._work, args=(slot,), daemon=True)
                for slot in range(self.jobs)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.errors:
            raise self.errors[0]
        if self.missing_metric:
            raise SweepUsageError(self.missing_metric)
        if self.stopping:
            return 128 + self.stopping
        return 0

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = signum
        logger.warning(
            "stopping the sweep: the trials running now save a checkpoint; run the same "
            "command again to continue"
        )
        with self._mutex:
            for child in self._children:
                child.send_signal(signum)

    def _work(self, slot: int) -> None:
        try:
            self._work_loop(slot)
        except BaseException as err:
            self.errors.append(err)
            self.stopping = self.stopping or 0

    def _work_loop(self, slot: int) -> None:
        while not self.stopping and not self.errors:
            job = self.next_job()
            if job is None:
                return
            try:
                self._train(job, slot)
                with self.sweep.locked():
                    self._settle(job)
                self.trained_here.append(job.record)
            finally:
                job.lock.release()

    def _train(self, job: Job, slot: int) -> None:
        argv = ["_worker", "-p", str(self.project_root), "--run-dir", str(job.run_dir)]
        if job.resume:
            checkpoint = _resume_from(job.run_dir)
            if checkpoint is not None:
                argv += ["--resume-from", str(checkpoint)]
        for module in self.allow:
            argv += ["--allow", module]
        record = job.record
        values = " ".join(f"{k}={_short(v)}" for k, v in record["params"].items())
        logger.info("trial %d: %s -> %s", record["trial"], values, job.run_dir)
        env = dict(os.environ, **device_env(slot, self.jobs))
        # several trials at once: each one's log in its run, not interleaved
        log = job.run_dir / "sweep.log" if self.jobs > 1 else None
        with self._mutex:
            if self.stopping:
                return
            # a process of its own, forked from a parent that imported torch once
            # (forge.sweep.trial_process), in a session of its own: Ctrl-C in a terminal
            # reaches the trial once, forwarded by _on_signal (a second signal would stop it
            # before its checkpoint is saved)
            child = TrialProcess(argv, env, log)
            self._children.add(child)
        try:
            child.wait()
        finally:
            with self._mutex:
                self._children.discard(child)

    def _settle(self, job: Job) -> None:
        """Record how the trial's run ended: its objective, pruned, or its error."""
        record = job.record
        try:
            data = RunRecord.load(job.run_dir).data
        except RunError as err:
            data = {"status": "failed", "error": str(err)}
        status = data.get("status")
        objective = self.sweep.spec.objective
        if status == "completed":
            value = last_value(job.run_dir, objective)
            if value is None:
                logged = sorted(logged_metrics(job.run_dir))
                from forge.suggest import suggestion

                message = (
                    f"--objective {objective}: trial {record['trial']}'s run never logged it "
                    f"(it logged {', '.join(logged) or 'nothing'})" + suggestion(objective, logged)
                )
                record.update(status="failed", error=message)
                self.missing_metric = message
            else:
                record.update(status="completed", value=value, error=None)
        elif status == "pruned":
            pruned = data.get("pruned") or {}
            record.update(status="pruned", value=pruned.get("value"), step=pruned.get("step"))
        elif status == "failed":
            record.update(status="failed", error=data.get("error") or "the run failed")
        else:  # interrupted or killed with the sweep: the next `forge sweep` resumes it
            if not self.stopping:
                record.update(status="failed", error=f"the run ended {status}")
            else:
                return
        record["finished"] = now_iso()
        step = data.get("step")
        if isinstance(step, int):
            record.setdefault("step", step)
        self.sweep.write(record)
        if self.study is not None:
            tell(self.study, record)
        value = record.get("value")
        shown = f" {objective}={value:.6g}" if isinstance(value, float) else ""
        extra = f": {record.get('error')}" if record["status"] == "failed" else ""
        logger.info("trial %d %s%s%s", record["trial"], record["status"], shown, extra)


def device_env(slot: int, jobs: int) -> dict[str, str]:
    """What splits the machine between ``jobs`` trials at once: one GPU each (in turn, when
    there are fewer GPUs than trials), or an equal share of the CPU cores."""
    if jobs <= 1:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g for g in visible.split(",") if g.strip()] if visible is not None else _gpus()
    if gpus:
        return {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]}
    threads = max((os.cpu_count() or 1) // jobs, 1)
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _gpus() -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()]


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _run_status(run_dir: Path) -> str | None:
    try:
        return RunRecord.load(run_dir).data.get("status")
    except RunError:
        return None


def _run_of_trial(sweep: Sweep, number: int) -> Path | None:
    """The run a killed sweep created for trial ``number`` before recording it, if any."""
    from forge.runs import config_output_dir, list_run_dirs

    output = sweep.directory.parent.parent
    for run_dir in list_run_dirs(config_output_dir(output, sweep.spec.config)):
        try:
            field = RunRecord.load(run_dir).data.get("sweep") or {}
        except RunError:
            continue
        if field.get("name") == sweep.name and field.get("trial") == number:
            return run_dir
    return None


def _resume_from(run_dir: Path) -> Path | None:
    """The run's newest valid checkpoint, as ``forge resume`` finds it, recorded as a resume
    in run.json; None when it saved none (the trial starts over in its run)."""
    from forge.checkpoint.resolve import CheckpointNotFound, resume_checkpoint
    from forge.runs import PROJECT_RUNS, record_resume

    try:
        checkpoint = resume_checkpoint(run_dir, run_dir, runs=PROJECT_RUNS)
    except CheckpointNotFound:
        return None
    record_resume(run_dir, checkpoint.path, overrides=[], world_size=1)
    return checkpoint.path


def read_metric_lines(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_value(run_dir: Path, metric: str) -> float | None:
    """The metric's value at the run's last step that logged it."""
    found = None
    for row in read_metric_lines(run_dir):
        value = row.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found = float(value)
    return found


def logged_metrics(run_dir: Path) -> set[str]:
    return {k for row in read_metric_lines(run_dir) for k in row if k not in ("step", "epoch")}
