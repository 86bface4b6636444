"""What ``forge train`` and ``forge resume`` do around a job's processes, shared with the Python
API (``forge.train``, ``forge.resume``), which trains in the calling process.

A new run is created from a checked config (:func:`new_run`) and claimed while it trains; a
config error that stops it before its first step removes it again (:func:`claimed_new_run`).
A resume is planned first (:func:`plan_resume`: the checkpoint, validated and hashed once, the
run's config with its ``--set`` overrides, or why there is nothing to do), checked against the
job that will run it (:func:`check_resume_fits`), and recorded while it runs
(:func:`recorded_resume`): a resume that fails before its first step leaves the run's config as
it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.error_kinds import is_usage_error
from forge.launch.errors import LaunchUsageError
from forge.launch.worker import TRAINER_TARGET, build_variables
from forge.runs import (
    PROJECT_RUNS,
    RunRecord,
    claim_run,
    config_output_dir,
    create_run,
    damaged_final_weights,
    discard_unstarted_run,
    failed_to_start,
    nothing_to_resume,
    now_iso,
    parse_run_config,
    record_resume,
    write_text_atomic,
)

if TYPE_CHECKING:
    from forge.checkpoint.resolve import Checkpoint
    from forge.config import Config, Project

logger = logging.getLogger(__name__)


def require_trainer(cfg: Config, name: str) -> None:
    """A config trains only through its ``trainer`` target."""
    if TRAINER_TARGET not in cfg.targets:
        raise LaunchUsageError(f"config '{name}' has no 'trainer' target; nothing to train")


def new_run(
    project: Project,
    name: str,
    cfg: Config,
    *,
    overrides: Sequence[str] = (),
    variables: Mapping[str, Any] | None = None,
    world_size: int = 1,
    fields: Mapping[str, Any] | None = None,
) -> Path:
    """The next ``run_NNN`` of config ``name``, holding its rendered config and record
    (``fields`` added to it: a scheduler's job id, a sweep trial's place)."""
    return create_run(
        config_output_dir(project.output_dir, name),
        config_name=name,
        config_text=cfg.text,
        project_root=project.root,
        overrides=list(overrides),
        variables=dict(variables or {}),
        nproc=world_size,
        fields=dict(fields) if fields else None,
    )


@contextlib.contextmanager
def claimed_new_run(run_dir: Path) -> Iterator[None]:
    """Hold a run created a moment ago while its job runs; a usage error (a config the
    processes refuse) that stops it before it trained a step removes the run."""
    try:
        with claim_run(run_dir):
            yield
    except Exception as err:
        if is_usage_error(err):
            discard_if_unstarted(run_dir)
        raise


def discard_if_unstarted(run_dir: Path) -> None:
    """Remove a run that never started (forge.runs.discard_unstarted_run), saying so."""
    if discard_unstarted_run(run_dir):
        logger.info("removed %s: the run never started", run_dir)


@dataclass
class ResumePlan:
    """What a resume of ``run_dir`` continues from and with which config; ``done`` says why
    there is nothing to train (the run is complete), else None."""

    run_dir: Path
    checkpoint: Checkpoint
    cfg: Config
    overrides: list[str] = field(default_factory=list)
    done: str | None = None


def plan_resume(
    project: Project,
    run_dir: Path,
    *,
    from_checkpoint: Path | None = None,
    overrides: Sequence[str] = (),
    allow: Sequence[str] = (),
) -> ResumePlan:
    """The checkpoint to resume ``run_dir`` from (``from_checkpoint``, else its newest valid
    one; validated and hashed here, once) and the run's config with ``overrides`` applied,
    checked. Nothing is written."""
    from forge.checkpoint.resolve import CheckpointNotFound, resume_checkpoint

    try:
        checkpoint = resume_checkpoint(from_checkpoint or run_dir, run_dir, runs=PROJECT_RUNS)
    except CheckpointNotFound as err:
        hint = (
            "" if from_checkpoint else " Start a new run with `forge train`, or pass --from CKPT."
        )
        raise CheckpointNotFound(f"{err}; nothing was changed.{hint}") from None
    overrides = list(overrides)
    cfg = parse_run_config(run_dir, project, overrides, list(allow))
    done = nothing_to_resume(
        run_dir, checkpoint.path, cfg, changed=bool(overrides or from_checkpoint)
    )
    # a checkpoint --from names is the user's choice; one discovery chose is the newest valid
    named = from_checkpoint is not None and from_checkpoint.resolve() == checkpoint.path.resolve()
    if not done and not named:
        damaged = damaged_final_weights(run_dir, checkpoint.path, project.root, resuming=True)
        if damaged is not None:
            logger.warning("%s", damaged)
    return ResumePlan(run_dir, checkpoint, cfg, overrides, done)


def recorded_world_size(run_dir: Path) -> int:
    """The process count the run last trained with (1 if its record does not say)."""
    return int(RunRecord.load(run_dir).data.get("world_size") or 1)


def check_resume_fits(
    run_dir: Path, cfg: Config, project: Project, allow: Sequence[str], world_size: int
) -> None:
    """As ``forge train`` checks a new run: the run's config ``cfg`` (changed by ``--set``, or
    by hand) must still feed its model and fit a job of ``world_size`` processes."""
    from forge.launch.preflight import check_training_contract

    variables = build_variables(run_dir, project, RunRecord.load(run_dir).data.get("config", ""))
    check_training_contract(
        cfg,
        variables,
        list(allow),
        config=str(run_dir / "config.yaml"),
        world_size=world_size,
    )


@contextlib.contextmanager
def recorded_resume(plan: ResumePlan, world_size: int) -> Iterator[None]:
    """Write the overridden config and record the resume in ``run.json`` while the job runs; a
    job that trained nothing (its worker recorded ``failed_resume``) leaves the config as it
    was (the ``--set`` is undone)."""
    run_dir = plan.run_dir
    config_file = run_dir / "config.yaml"
    kept = config_file.read_text() if plan.overrides else None
    if plan.overrides:
        write_text_atomic(config_file, plan.cfg.text)
    record_resume(run_dir, plan.checkpoint.path, overrides=plan.overrides, world_size=world_size)
    launched = now_iso()
    try:
        yield
    finally:
        if kept is not None and failed_to_start(run_dir, since=launched):
            write_text_atomic(config_file, kept)
            logger.info("%s/config.yaml is as it was before this resume", run_dir.name)


__all__ = [
    "ResumePlan",
    "check_resume_fits",
    "claimed_new_run",
    "discard_if_unstarted",
    "new_run",
    "plan_resume",
    "recorded_resume",
    "recorded_world_size",
    "require_trainer",
]
