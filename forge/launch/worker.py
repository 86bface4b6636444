"""What every training process runs: rebuild the trainer from a run's saved config and train.

``forge train`` renders and checks the config, creates the run directory and then runs
:func:`run_worker` in-process (one process) or under torchrun (``--nproc`` > 1), where each
rank calls it. The trainer never sees YAML: it is built from the ``trainer`` target.

Under ``--max-restarts N`` torchrun's elastic agent starts every worker again when one dies;
a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) continues from the newest valid
checkpoint of its run, and rank 0 records the restart in ``run.json``.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.config import ConfigError, Problem, Project, parse_config
from forge.error_kinds import is_usage_error
from forge.launch.multinode import peer_loss
from forge.runs import (
    EXIT_DIVERGED,
    PROJECT_RUNS,
    RunRecord,
    current_record,
    hold_training_lock,
    now_iso,
    resume_command,
)
from forge.train.rollback import rollback_anchor_before
from forge.train.topology import Topology

if TYPE_CHECKING:
    from forge.checkpoint.resolve import Checkpoint
    from forge.train import TrainingInterrupted, TrainOutput

logger = logging.getLogger(__name__)

TRAINER_TARGET = "trainer"
# which rank died before a restart and how: set by forge's agent (forge.launch.torchrun)
RESTART_CAUSE_ENV = "FORGE_RESTART_CAUSE"


def build_variables(run_dir: Path, project: Project, config_name: str) -> dict[str, Any]:
    """The values ``!var`` nodes may ask for at build time."""
    topology = Topology.from_env()
    return {
        "run_dir": str(run_dir),
        "project_dir": str(project.root),
        "output_root": str(project.output_dir),
        "config_name": config_name,
        "rank": topology.rank,
        "world_size": topology.world_size,
        "local_rank": topology.local_rank,
    }


def load_run_config(run_dir: Path, project: Project, allow: list[str] = ()):
    """Parse and check a run's ``config.yaml``; ConfigError lists every problem."""
    path = run_dir / "config.yaml"
    cfg = parse_config(path.read_text(), project=project, allow=list(allow), origin=str(path))
    problems = cfg.check()
    if problems:
        raise ConfigError(problems, config=str(path))
    if TRAINER_TARGET not in cfg.targets:
        message = (
            f"no '{TRAINER_TARGET}' target; a training config defines `trainer:` "
            "(extend 'base.yaml' and fill its trainer block)"
        )
        raise ConfigError([Problem(message=message, file=str(path), line=None, key_path=None)])
    return cfg


def make_run_record_callback(record: RunRecord, restart: int = 0):
    """A trainer callback that keeps ``run.json`` current at every checkpoint, records the
    end-of-training summary (``train_runtime``, ``train_samples_per_second``, ...) as
    ``train_summary`` (and, with ``auto_find_batch_size``, the micro-batch that fitted:
    ``train_batch_size``), and, in a worker torchrun restarted, the restart and the checkpoint
    it continued from (known once the trainer has resolved it)."""
    import math

    from forge.train import TrainerCallback
    from forge.train.batch_finder import found_batch_record
    from forge.train.callbacks import is_train_summary

    class RunRecordCallback(TrainerCallback):
        began = False  # the loop started: a failure from here on is the run's own

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = True
            if restart:
                record_restart(record, restart, state.resumed_from)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and is_train_summary(logs):
                summary = {
                    k: v if not isinstance(v, float) or math.isfinite(v) else None
                    for k, v in logs.items()
                }
                record.update(
                    train_summary={"step": state.global_step, **summary},
                    **found_batch_record(args, state),
                )

        def on_save(self, args, state, control, checkpoint_path=None, metrics=None, **kwargs):
            best = None
            if state.best_checkpoint is not None:
                best = {
                    "checkpoint": os.path.relpath(state.best_checkpoint, record.run_dir),
                    "metric": args.metric_for_best_model,
                    "value": state.best_metric,
                    # how forge checkpoints ranks the kept ones (save_top_k)
                    "greater_is_better": bool(args.greater_is_better),
                    "top_k": args.save_top_k,
                }
            record.data.update(found_batch_record(args, state))  # auto_find_batch_size's
            record.add_checkpoint(
                Path(checkpoint_path),
                state.global_step,
                metrics or {},
                best,
                data=getattr(state, "stream_position", None),  # a stream's, rank 0's
            )

    return RunRecordCallback()


#: the statuses of a run no job is training: what a resume that fails to start leaves in place
ENDED = ("completed", "failed", "interrupted", "killed", "pruned", "diverged")


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this job's workers (0 if none)."""
    try:
        return max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), 0)
    except ValueError:
        return 0


def record_restart(record: RunRecord, restart: int, checkpoint: str | None) -> None:
    """Add this restart to run.json: when, from which checkpoint, after which rank died
    (torchrun's agent names it: forge.launch.torchrun)."""
    cause = os.environ.get(RESTART_CAUSE_ENV) or None
    restarts = record.data.get("restarts", [])
    restarts.append(
        {
            "at": now_iso(),
            "restart": restart,
            "from": str(checkpoint) if checkpoint else None,
            "after": cause,
        }
    )
    record.update(restarts=restarts)
    where = f"from {checkpoint}" if checkpoint else "from the beginning (no checkpoint yet)"
    after = f" ({cause})" if cause else ""
    logger.warning(
        "restart %d of the workers (--max-restarts): continuing %s%s", restart, where, after
    )


def reached_step(trainer: Any) -> int:
    """The optimizer steps a trainer has taken (0 before it was built), for run.json: a run
    that trained a step is never taken for one that never started."""
    state = getattr(trainer, "state", None)
    return int(getattr(state, "global_step", 0) or 0)


def stopped_message(stop: TrainingInterrupted, run_dir: Path, project: Project) -> str:
    """What a job stopped by a signal tells the user: where it stopped and how to go on."""
    name = signal.Signals(stop.signum).name
    return (
        f"stopped by {name} at step {stop.step}; checkpoint {stop.checkpoint} holds it. "
        f"Continue with: {resume_command(run_dir, project.root)}"
    )


def _pruning_callback(record: RunRecord):
    """A sweep trial whose study prunes reports each evaluation to it (forge.sweep)."""
    sweep = record.data.get("sweep") or {}
    if not sweep.get("storage") or sweep.get("pruner", "none") == "none":
        return None
    from forge.sweep.pruning import PruningCallback

    return PruningCallback(sweep)


def pruned_message(record: RunRecord, pruned: dict[str, Any]) -> str:
    sweep = record.data.get("sweep") or {}
    return (
        f"trial {sweep.get('trial')} of sweep {sweep.get('name')} pruned at step "
        f"{pruned['step']} ({sweep.get('objective')}={pruned['value']:.6g}); its checkpoint "
        f"is in {record.run_dir.name}/checkpoints"
    )


def locate_user_code_failure(
    err: BaseException, cfg: Any, project: Project, record: RunRecord, allow: list[str] = ()
) -> None:
    """A trainer part that failed while training (``trainer.compute_metrics`` at an evaluation:
    forge.train.user_code) is given the config line that sets it, as the sanity pass gives it:
    the template's line where the templates still render the run's config, else the line of
    the run's ``config.yaml``."""
    part = getattr(err, "part", None)
    if cfg is None or part is None or not hasattr(err, "where"):
        return
    try:  # the templates' lines, where they still render what the run trained
        from forge.config import load_config

        data = record.data
        fresh = load_config(
            project, data["config"], data.get("variables"), data.get("overrides") or [], allow
        )
        if fresh.text == cfg.text:
            cfg = fresh
    except Exception as exc:  # edited or gone since: the run's own config.yaml says it
        logger.debug("the run's templates do not render its config (%s)", exc)
    err.where = part_location(cfg, part)


def part_location(cfg: Any, part: str) -> str | None:
    """Where the config sets the trainer's ``part`` (its node, else the trainer's key)."""
    from forge.config.graph import CallNode, Node

    trainer = cfg.targets.get(TRAINER_TARGET)
    if not isinstance(trainer, CallNode):
        return None
    node = trainer.kwargs.get(part)
    loc = node.loc if isinstance(node, Node) else trainer.arg_locs.get(part)
    return (cfg.location_text(loc) or None) if loc is not None else None


def divergence(trainer: Any) -> dict[str, Any] | None:
    """What a divergence detector (forge.train.divergence) stopped the run for, or None."""
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        found = getattr(callback, "diverged", None)
        if isinstance(found, dict):
            return found
    return None


def rollback_history(trainer: Any) -> list[dict[str, Any]]:
    """Every rollback a divergence detector made (from step, to checkpoint, batches skipped)."""
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        found = getattr(callback, "rollbacks", None)
        if isinstance(found, list) and found:
            return found
    return []


def diverged_message(found: dict[str, Any], checkpoint: str | None) -> str:
    checkpoint = checkpoint or "no checkpoint (save_final_checkpoint is off)"
    return (
        f"diverged at step {found['step']} ({found['detector']}): {found['message']}; "
        f"stopped with {checkpoint}"
    )


def run_worker(
    run_dir: Path,
    project: Project,
    *,
    resume_from: Checkpoint | str | None = None,
    allow: list[str] = (),
) -> int:
    """Build the trainer from ``run_dir/config.yaml`` and train; returns the exit code
    (128 + N when signal N stopped it, after a checkpoint).

    ``resume_from`` is the checkpoint the launching command resolved (forge.checkpoint.resolve),
    as a ``Checkpoint`` in this process, or its path in a process torchrun started (checked
    again, not hashed again), or None for the start.
    """
    from forge.train import TrainingInterrupted

    try:
        train_run(run_dir, project, resume_from=resume_from, allow=allow)
    except TrainingInterrupted as stop:
        return 128 + int(stop.signum)
    if (run_dir / "run.json").is_file() and RunRecord.load(run_dir).data.get(
        "status"
    ) == "diverged":
        return EXIT_DIVERGED  # a divergence detector stopped it (rank 0 recorded why)
    return 0


def train_run(
    run_dir: Path,
    project: Project,
    *,
    resume_from: Checkpoint | str | None = None,
    allow: list[str] = (),
) -> TrainOutput:
    """:func:`run_worker`'s training: the trainer's ``TrainOutput``, the run's record kept as
    the worker keeps it; a signal's stop is recorded and raised (``TrainingInterrupted``)."""
    from forge.checkpoint.resolve import Checkpoint, Restart, checked_by_launcher, use_run_lookup
    from forge.train import TrainingInterrupted

    use_run_lookup(PROJECT_RUNS)  # a config's resume_from_checkpoint may name a project

    run_dir = Path(run_dir)
    topology = Topology.from_env()
    rank, world_size = topology.rank, topology.world_size
    # caught up with checkpoints committed after its last update (a kill in between)
    record = current_record(run_dir, repair=False)
    if resume_from is not None and not isinstance(resume_from, Checkpoint):
        resume_from = checked_by_launcher(resume_from)
    restart = restart_count()
    if restart:
        resume_from = Restart(run_dir, resume_from)
    lock = hold_training_lock(run_dir) if rank == 0 else None
    trainer = callback = cfg = None
    previous = record.data.get("status")  # what a resume that fails to start leaves in place
    try:
        cfg = load_run_config(run_dir, project, allow)
        variables = build_variables(run_dir, project, record.data.get("config", "config"))
        trainer = cfg.build(TRAINER_TARGET, variables)
        pruning = _pruning_callback(record)
        if pruning is not None:
            trainer.add_callback(pruning)
        if rank == 0:
            callback = make_run_record_callback(record, restart)
            trainer.add_callback(callback)
            record.set_status("running", world_size=world_size, started=now_iso())
            anchor_before = rollback_anchor_before(trainer.callback_handler.callbacks)
            if anchor_before is not None:  # forge checkpoints names the kept rollback anchor
                record.update(rollback_anchor_before=anchor_before)
        output = trainer.train(resume_from_checkpoint=resume_from)
        diverged = divergence(trainer)
        if rank == 0:
            record = RunRecord.load(run_dir)
            rollbacks = rollback_history(trainer)
            if rollbacks:
                record.update(rollbacks=rollbacks)
            if diverged is not None:
                step = trainer.state.global_step
                record.set_status("diverged", finished=now_iso(), step=step, diverged=diverged)
                logger.error("%s", diverged_message(diverged, trainer.state.last_checkpoint))
            elif pruning is not None and pruning.pruned is not None:
                record.set_status("pruned", finished=now_iso(), pruned=pruning.pruned)
                logger.info("%s", pruned_message(record, pruning.pruned))
            else:
                record.set_status("completed", finished=now_iso(), step=trainer.state.global_step)
    except TrainingInterrupted as stop:
        began = getattr(callback, "began", False)
        if rank == 0 and stop.step is None and not began:  # before the first step: no save
            record = RunRecord.load(run_dir)
            name = signal.Signals(stop.signum).name
            if restart:
                record.set_status("interrupted", signal=name, reached_step=reached_step(trainer))
            else:  # the run is as this job found it: a new one (removed) or a resumed one
                record.update(status=previous)
            logger.info("stopped by %s before training started: nothing to save", name)
        elif rank == 0:
            record = RunRecord.load(run_dir)
            record.set_status(
                "interrupted",
                signal=signal.Signals(stop.signum).name,
                reached_step=reached_step(trainer),
            )
            logger.info("%s", stopped_message(stop, run_dir, project))
        raise
    except BaseException as err:
        locate_user_code_failure(err, cfg, project, record, allow)
        lost = peer_loss(err) if world_size > 1 else None
        if rank == 0:
            record = RunRecord.load(run_dir)
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            kind = "usage" if is_usage_error(err) else "runtime"
            resumed = resume_from is not None and not restart and previous in ENDED
            if resumed and not getattr(callback, "began", False):
                # a resume that failed before its first step trained nothing: the run is as
                # it was (completed, interrupted...); the attempt is recorded beside it
                record.update(
                    status=previous,
                    failed_resume={"at": now_iso(), "error": str(lost or err), "kind": kind},
                )
            elif lost is None or record.data.get("status") != "killed":  # the cause is kept
                record.set_status(
                    status,
                    error=str(lost or err),
                    error_type=type(lost or err).__name__,
                    error_kind=kind,
                    reached_step=reached_step(trainer),
                )
        if lost is not None:
            raise lost from err
        raise
    finally:
        if lock is not None:
            lock.release()
    return output
