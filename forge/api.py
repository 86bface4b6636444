"""forge as a library: the Python API, re-exported by ``forge`` itself.

``forge.render`` renders a config (the text ``forge render`` prints, and its object graph),
``forge.build`` builds its objects without training, ``forge.train`` / ``forge.resume`` run a
run in this process, and ``forge.load`` gives a checkpoint's or run's model ready for
``eval()``. They take what the commands take (``variables`` for ``-D``, ``overrides`` for
``--set``, ``allow`` for ``--allow``) and go through the same code: a mistake raises the
exception whose message the command prints (``ConfigError`` with every problem located at its
template file and line, ``CheckpointNotFound``, ``RunError``, ...), and a run trained here is a
run as ``forge train`` makes it (its directory, ``run.json``, checkpoints; ``forge resume``
continues it).

Rendering imports no torch; building, training and loading do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.config import ConfigError, Problem, Project, find_project, load_config, load_project

if TYPE_CHECKING:
    import torch
    from torch import nn

    from forge.config import Config
    from forge.train import TrainOutput

logger = logging.getLogger(__name__)

__all__ = ["TrainedRun", "build", "load", "render", "resume", "train"]

PathLike = str | os.PathLike


@dataclass(frozen=True)
class TrainedRun:
    """What ``forge.train`` / ``forge.resume`` leave: the run directory and the trainer's
    ``TrainOutput`` (global step, training loss, metrics); ``output`` is None for a resume
    that had nothing to train (``note`` says why)."""

    run_dir: Path
    output: TrainOutput | None
    note: str | None = None


def render(
    config: str | None = None,
    *,
    project: PathLike | Project | None = None,
    variables: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    allow: Sequence[str] = (),
) -> Config:
    """A project's config rendered and parsed, as ``forge render`` shows it; nothing is built
    and no user code is imported.

    ``config``: its name (``train``, ``train.yaml``; default: the project's
    ``default_config``); ``project``: its directory (default: the nearest ancestor of the
    working directory with a ``meta.yaml``); ``variables``: template variables (``-D``);
    ``overrides``: ``key.path=value`` (``--set``). The result's ``text`` is what ``forge
    render`` prints, ``resolved_text()`` what ``--resolved`` prints, ``targets`` the object
    graph, ``check()`` every problem of its callables. A ConfigError lists every problem,
    each with its template file and line.
    """
    _, cfg = _load(config, project, variables, overrides, allow)
    return cfg


def build(
    config: str | None = None,
    target: str | Sequence[str] | None = None,
    *,
    project: PathLike | Project | None = None,
    variables: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    allow: Sequence[str] = (),
    run_dir: PathLike | None = None,
) -> Any:
    """The objects of a config (``target``: one target's object, a list of them: a dict by
    name, None: every public target), after the check ``forge build`` makes; nothing is
    trained. ``run_dir`` is the value of ``!var run_dir`` (default: the project's
    ``output/build``). The other arguments are :func:`render`'s."""
    from forge.launch.worker import build_variables

    _install_run_lookup()
    project = _project(project)
    name, cfg = _load(config, project, variables, overrides, allow, check=True)
    names = cfg.public_targets if target is None else target
    built_at = Path(run_dir) if run_dir is not None else project.output_dir / "build"
    return cfg.build(names, build_variables(built_at, project, name))


def train(
    config: str | None = None,
    *,
    project: PathLike | Project | None = None,
    variables: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    allow: Sequence[str] = (),
    nproc: int = 1,
) -> TrainedRun:
    """Train a config in this process, as ``forge train`` does for one process: the config
    checked (its batches against the model's forward too) before a new ``run_NNN`` is
    created, then trained; the run's record and checkpoints are those of the command's runs.

    Returns the run directory and the ``TrainOutput``. A config mistake raises ConfigError
    (and a run that never started is removed); SIGINT / SIGTERM stop at the next step with a
    checkpoint and raise ``TrainingInterrupted``. Several processes (``nproc`` > 1) are the
    command line's: ``forge train CONFIG --nproc N`` starts them under torchrun.
    """
    from forge.launch.length_note import length_note, moot_arguments
    from forge.launch.preflight import check_training_contract
    from forge.launch.start import claimed_new_run, new_run, require_trainer
    from forge.launch.worker import build_variables, train_run
    from forge.runs import config_output_dir

    _one_process("train", nproc, "forge train CONFIG --nproc N")
    _install_run_lookup()
    project = _project(project)
    name, cfg = _load(config, project, variables, overrides, allow, check=True)
    require_trainer(cfg, name)
    next_run = config_output_dir(project.output_dir, name) / "run_NNN"
    check_training_contract(
        cfg, build_variables(next_run, project, name), list(allow), config=name, world_size=1
    )
    for sentence in [length_note(cfg), *(said for _, said in moot_arguments(cfg))]:
        if sentence:  # what `forge train` warns of: which argument decides, which are moot
            logger.warning("%s", sentence)
    run_dir = new_run(project, name, cfg, overrides=overrides, variables=variables, world_size=1)
    logger.info("run directory: %s", run_dir)
    with claimed_new_run(run_dir):
        output = train_run(run_dir, project, allow=list(allow))
    return TrainedRun(run_dir, output)


def resume(
    run: PathLike | int | None = None,
    *,
    project: PathLike | Project | None = None,
    config: str | None = None,
    overrides: Sequence[str] = (),
    allow: Sequence[str] = (),
    from_checkpoint: PathLike | None = None,
    nproc: int = 1,
) -> TrainedRun:
    """Continue a run in this process, as ``forge resume`` does for one process: from its
    newest valid checkpoint (or ``from_checkpoint``), with ``overrides`` (``--set``) applied
    to its config. ``run``: a run directory, a run number (of ``config``, when several configs
    have one), or None for the project's newest run. A run that is complete returns
    ``output`` None and says why in ``note``. Errors as :func:`train`."""
    from forge.launch.start import (
        check_resume_fits,
        plan_resume,
        recorded_resume,
    )
    from forge.launch.worker import train_run
    from forge.runs import claim_run, find_run, stale_running_note

    _one_process("resume", nproc, "forge resume --nproc N")
    _install_run_lookup()
    project = _project(project)
    given = Path(run) if isinstance(run, (str, os.PathLike)) else None
    run_dir = find_run(
        project.output_dir,
        number=run if isinstance(run, int) else None,
        run_dir=given,
        config_name=project.resolve_config_name(config) if config else None,
    )
    stale = stale_running_note(run_dir)
    with claim_run(run_dir):  # refused while the run trains
        if stale:
            logger.warning("%s", stale)
        plan = plan_resume(
            project,
            run_dir,
            from_checkpoint=Path(from_checkpoint).resolve() if from_checkpoint else None,
            overrides=overrides,
            allow=allow,
        )
        if plan.done:
            logger.info("%s", plan.done)
            return TrainedRun(run_dir, None, plan.done)
        check_resume_fits(run_dir, plan.cfg, project, allow, world_size=1)
        logger.info("resuming %s from %s", run_dir, plan.checkpoint)
        with recorded_resume(plan, world_size=1):
            output = train_run(run_dir, project, resume_from=plan.checkpoint, allow=list(allow))
    return TrainedRun(run_dir, output)


def load(
    path: PathLike,
    *,
    best: bool = False,
    ema: bool = False,
    merge_lora: bool = False,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    allow: Sequence[str] = (),
) -> nn.Module:
    """The model of a checkpoint, run (its newest valid checkpoint; ``best``: its best one)
    or project (its newest run), with its weights, in eval mode, on ``device`` in ``dtype``
    (defaults: the CPU, the dtype it was built in). Its logits are bit for bit those ``forge
    evaluate`` computes from the same checkpoint. ``ema``: the moving average of the weights
    the checkpoint holds; ``merge_lora``: a LoRA checkpoint's adapter merged into its base
    (without it, a peft model). ``forge.read.CheckpointReader`` gives the rest: the config,
    the metrics, the state dict, the tokenizer."""
    from forge.read.reader import CheckpointReader

    reader = CheckpointReader(path, best=best, allow=list(allow))
    return reader.model(ema=ema, merge_lora=merge_lora, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------


def _project(project: PathLike | Project | None) -> Project:
    if isinstance(project, Project):
        return project
    if project is None:
        return find_project(Path.cwd())
    return load_project(Path(project))


def _load(
    config: str | None,
    project: PathLike | Project | None,
    variables: Mapping[str, Any] | None,
    overrides: Sequence[str],
    allow: Sequence[str],
    *,
    check: bool = False,
) -> tuple[str, Config]:
    """The config's name and the config rendered and parsed (``check``: its callables
    checked too), as the commands load it."""
    project = _project(project)
    name = config or project.default_config
    if not name:
        message = "no config given and the project names no default_config; configs: " + (
            ", ".join(project.list_configs()) or "none"
        )
        raise ConfigError(Problem(message, file=str(project.meta_file)))
    name = project.resolve_config_name(name)
    cfg = load_config(
        project, name, variables=dict(variables or {}), overrides=list(overrides), allow=allow
    )
    if check:
        problems = cfg.check()
        if problems:
            raise ConfigError(problems, config=name)
    return name, cfg


def _one_process(command: str, nproc: int, cli: str) -> None:
    from forge.launch.errors import LaunchUsageError
    from forge.train.topology import Topology

    if nproc != 1:
        raise LaunchUsageError(
            f"forge.{command} trains in this process (nproc=1; got {nproc}); several processes "
            f"are started by the command line: `{cli}` (torchrun under it)"
        )
    topology = Topology.from_env()
    if topology.distributed:
        raise LaunchUsageError(
            f"this process is rank {topology.rank} of {topology.world_size} started by a "
            f"launcher; forge.{command} trains in one process: run `{cli.split(' --')[0]}` "
            "under the launcher instead"
        )


def _install_run_lookup() -> None:
    """A project directory or ``best`` names a run's checkpoint through forge.runs (as in the
    commands: a LoRA config's base_model may name a run or project)."""
    from forge.checkpoint.resolve import use_run_lookup
    from forge.runs import PROJECT_RUNS

    use_run_lookup(PROJECT_RUNS)
