"""One thin function per ``forge`` command: read the arguments, call the part that does the
work, print the result. Each returns the exit code.

Heavy modules are imported inside the commands that need them, so ``forge ls`` or
``forge render`` never load torch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from forge.cli.exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, UsageError, exit_code_for
from forge.cli.table import table as _table
from forge.config import ConfigError, Project, find_project, load_config, load_project
from forge.config import parse_define as _parse_define
from forge.config.analysis import unused_variables
from forge.train.topology import Topology

logger = logging.getLogger("forge")


# --------------------------------------------------------------------------- helpers


def _project(args: argparse.Namespace) -> Project:
    """-p's project; else the one holding --run-dir's run, or the working directory."""
    if getattr(args, "project", None):
        return load_project(Path(args.project))
    run_dir = getattr(args, "run_dir", None)
    if isinstance(run_dir, str) and (Path(run_dir) / "run.json").is_file():
        with contextlib.suppress(ConfigError):  # a run moved out of its project: the cwd's
            return find_project(Path(run_dir))  # a run lies in its project's output/
    return find_project(Path.cwd())


def _defines(args: argparse.Namespace) -> dict[str, Any]:
    return dict(_parse_define(item) for item in (args.define or []))


def _config_name(args: argparse.Namespace, project: Project) -> str:
    name = args.config or project.default_config
    if not name:
        raise UsageError(
            f"no CONFIG given and {project.root / 'meta.yaml'} names no default_config; "
            f"configs: {', '.join(project.list_configs()) or 'none'}"
        )
    return project.resolve_config_name(name)


def _load(args: argparse.Namespace, project: Project, *, check: bool = True):
    name = _config_name(args, project)
    cfg = load_config(
        project,
        name,
        variables=_defines(args),
        overrides=args.set or [],
        allow=args.allow or [],
    )
    if check:
        problems = cfg.check()
        if problems:
            raise ConfigError(problems, config=name)
    return name, cfg


def _graph_problems(cfg) -> list:
    """The problems found while parsing (tags, !var, keys), without importing any callable."""
    return [cfg.problem(p.loc, p.message, p.hint) for p in cfg._graph_problems]


def _clip(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# --------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    project = _project(args)
    defines = _defines(args)
    rows, broken, read = [], [], set()
    for name in project.list_configs():
        try:
            # A -D needs to be read by some config, not by each of them (checked below).
            cfg = load_config(
                project, name, variables=defines, allow=args.allow or [], check_variables=False
            )
            read |= cfg.variables_read()
            # Checking imports every callable (and so torch); without --check only the
            # render, the YAML and the graph are checked.
            problems = cfg.check() if args.check else _graph_problems(cfg)
        except ConfigError as err:
            problems = err.problems
        status = f"{len(problems)} problem(s)" if problems else "ok" if args.check else "renders"
        if problems:
            broken.append((name, problems))
        default = "*" if name == project.default_config else ""
        rows.append([name + default, status])
    unread = unused_variables(defines, read, "config of this project") if rows else []
    if unread:
        raise ConfigError(unread)
    print(f"project {project.name}: {project.description}".rstrip(": "))
    print(_table(rows, ["CONFIG", "CHECK"]) if rows else "(no configs in templates/configs/)")
    for name, problems in broken:
        print(f"\n{name}:\n" + str(ConfigError(problems)), file=sys.stderr)
    if rows and not args.check:
        print(
            "(rendered and parsed only; without --no-check every callable is imported and checked)",
            file=sys.stderr,
        )
    return EXIT_USAGE if broken else EXIT_OK


def cmd_render(args: argparse.Namespace) -> int:
    project = _project(args)
    _, cfg = _load(args, project, check=False)
    if args.chain:
        for index, (template, path) in enumerate(cfg.chain):
            print(f"{index:2d}  {template:40s} {path}")
    elif args.graph:
        print(cfg.describe_graph())
    elif args.resolved:
        sys.stdout.write(cfg.resolved_text())
    else:
        sys.stdout.write(cfg.text if cfg.text.endswith("\n") else cfg.text + "\n")
    return EXIT_OK


def cmd_vars(args: argparse.Namespace) -> int:
    from forge.config.render import builtin_variables, render_config
    from forge.config.variables import variable_rows

    if args.set or args.allow:
        given = "--set" if args.set else "--allow"
        raise UsageError(
            f"forge vars lists template variables (-D VAR=VALUE); {given} acts on the rendered "
            "YAML, which it does not read. See a --set's effect with "
            "`forge render CONFIG --resolved --set KEY.PATH=VALUE`"
        )
    project = _project(args)
    name = _config_name(args, project)
    defines = _defines(args)
    rendered = render_config(project, name, defines)
    rows = variable_rows(rendered, defines, builtin_variables(project, name))
    table = [[r.name, _clip(r.value), _clip(r.default), r.where] for r in rows]
    print(_table(table, ["VARIABLE", "VALUE", "DEFAULT", "WHERE"]))
    return EXIT_OK


def cmd_build(args: argparse.Namespace) -> int:
    from forge.launch.worker import build_variables

    project = _project(args)
    name, cfg = _load(args, project)
    variables = build_variables(Path(args.run_dir or project.output_dir / "build"), project, name)
    obj = cfg.build(args.target, variables)
    print(repr(obj))
    return EXIT_OK


def _nodes(args: argparse.Namespace):
    """This node's view of the job (forge's flags, options after --, SLURM) and the torchrun
    arguments left to pass on."""
    from forge.launch.cluster import resolve_nodes

    return resolve_nodes(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        master_addr=args.master_addr,
        master_port=args.master_port,
        torchrun_args=args.torchrun_args,
    )


_NODE_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "master_addr", "master_port")


def _join(
    args: argparse.Namespace,
    project: Project,
    nproc: int,
    nodes,
    rest,
    restarts,
    here,
    config_text: str | None = None,
) -> int:
    """A node other than node 0: start this node's workers, which learn the run from node 0's
    (once this node's agent has checked that it runs what node 0 runs: ``here``, the config
    it rendered); the run directory goes to stdout once known (after the job)."""
    from forge.launch.torchrun import join_job

    code, run_dir = join_job(
        project,
        nproc,
        nodes,
        here,
        config_text,
        torchrun_args=rest,
        allow=args.allow or [],
        verbose=args.verbose,
        max_restarts=restarts,
    )
    if run_dir is not None:
        print(run_dir, flush=True)
    return code


def _memory_option(args: argparse.Namespace) -> int | None:
    """``--memory`` in bytes (None when not given); it belongs to ``--dry-run``."""
    if getattr(args, "memory", None) is None:
        return None
    if not args.dry_run:
        raise UsageError(
            "--memory sizes the plan's largest per-device batch and goes with --dry-run; "
            "to shrink the batch while training, set trainer.args.auto_find_batch_size: true"
        )
    from forge.launch.batch_fit import parse_memory

    try:
        return parse_memory(args.memory)
    except ValueError as err:
        raise UsageError(str(err)) from err


def _refuse_launcher_options(args, topology: Topology, max_restarts: int) -> None:
    """In a job another launcher started, the options that start, restart or requeue the job's
    processes are that launcher's (or the job script's): refused, naming the first."""
    node_flags = [n for n in _NODE_FLAGS if getattr(args, n) is not None]
    flag = None
    if node_flags:
        flag = "--" + node_flags[0].replace("_", "-") + " (give it to that launcher)"
    elif max_restarts:
        flag = "--max-restarts (give it to that launcher)"
    elif args.nproc not in (None, "1"):
        flag = "--nproc"
    elif args.requeue:
        flag = "--requeue (forge requeues only a job it launched: forge train --nproc N in sbatch)"
    if flag:
        raise UsageError(
            f"this process is already rank {topology.rank} of {topology.world_size} started by "
            f"another launcher (accelerate launch, torchrun); drop {flag}"
        )


def cmd_train(args: argparse.Namespace) -> int:
    topology = Topology.from_env()
    if not topology.distributed:
        return _train(args, topology)
    from forge.launch.torchrun import launched_job_group

    # every rank of a job another launcher started (accelerate launch, a user's torchrun): one
    # process group for the whole command, the checks before training included
    with launched_job_group(topology):
        return _train(args, topology)


def _train(args: argparse.Namespace, topology: Topology) -> int:
    from forge.launch.cluster import ONE_NODE, check_host
    from forge.launch.endpoint import Here
    from forge.launch.length_note import length_note, moot_arguments
    from forge.launch.preflight import check_training_contract
    from forge.launch.scheduler import (
        check_requeue,
        job_fields,
        requeue_after_stop,
        requeued_run,
        stopped_codes,
        use_stop_signal,
    )
    from forge.launch.start import (
        claimed_new_run,
        discard_if_unstarted,
        new_run,
        require_trainer,
    )
    from forge.launch.torchrun import launch_training, resolve_max_restarts, resolve_nproc
    from forge.launch.worker import build_variables
    from forge.runs import config_output_dir, discard_unstarted_run
    from forge.train.signals import TrainingInterrupted, stop_while_starting

    memory = _memory_option(args)
    use_stop_signal(args.stop_signal)
    stop_while_starting()  # a stop before the loop ends the job cleanly (no step to save)
    check_requeue(args.requeue)
    project = _project(args)
    name, cfg = _load(args, project)
    nproc = resolve_nproc(args.nproc)
    max_restarts = resolve_max_restarts(args.max_restarts)
    require_trainer(cfg, name)
    if topology.distributed:
        _refuse_launcher_options(args, topology, max_restarts)
    nodes, torchrun_args = (ONE_NODE, args.torchrun_args) if topology.distributed else _nodes(args)
    # Before any run directory exists: do the batches fit the model's forward, and does the
    # trainer's plan (a pipeline split) fit a job of this many processes?
    next_run = config_output_dir(project.output_dir, name) / "run_NNN"
    variables = build_variables(next_run, project, name)
    world_size = topology.world_size if topology.distributed else nproc * nodes.nnodes
    plan = check_training_contract(
        cfg, variables, args.allow or [], config=name, world_size=world_size
    )
    length = length_note(cfg)
    moot = [sentence for _, sentence in moot_arguments(cfg)]
    if args.dry_run and not topology.is_main:  # under a launcher: rank 0 prints the plan
        return EXIT_OK
    if args.dry_run:
        from forge.launch.job_plan import make_plan

        nproc = topology.world_size if topology.distributed else nproc
        per_node = f" per node, {nodes.describe()}," if nodes.multinode else ""
        print(
            f"config {name} renders and checks; would train with {nproc} process(es){per_node} in"
        )
        print(f"  {next_run}/")
        if length:
            print(f"  {length}")
        for sentence in moot:
            print(f"  {sentence}")
        for line in plan:
            print(line)
        figures = make_plan(
            cfg,
            variables,
            args.allow or [],
            world_size=world_size,
            nnodes=nodes.nnodes,
            checkpoints_dir=f"{next_run}/checkpoints/",
            memory=memory,
        )
        for line in figures:
            print(line)
        return EXIT_OK
    if length and topology.is_main and nodes.creates_run:
        logger.warning("%s", length)
    if topology.is_main and nodes.creates_run:
        for sentence in moot:
            logger.warning("%s", sentence)
    if nodes.multinode:
        check_host(nodes)  # before anything starts: a host that never resolves is named here
    if not nodes.creates_run:
        here = Here("train", name)
        return _join(args, project, nproc, nodes, torchrun_args, max_restarts, here, cfg.text)
    requeued = None if topology.distributed else requeued_run(project.output_dir, name, cfg.text)
    if requeued is not None:  # SLURM requeued this job: it continues the run it started
        logger.info("SLURM requeued this job: continuing %s", requeued)
        args.set, args.from_checkpoint, args.torchrun_args = None, None, torchrun_args
        # the other nodes run `forge train` again too: node 0 says it runs that, this config
        here = Here("train", name, requeued / "config.yaml")
        return _resume_run(args, project, requeued, max_restarts, nodes, here)

    def make_run() -> Path:
        return new_run(
            project,
            name,
            cfg,
            overrides=args.set or [],
            variables=_defines(args),
            world_size=topology.world_size if topology.distributed else nproc * nodes.nnodes,
            fields=job_fields(),
        )

    if topology.distributed:  # every rank of a job another launcher started runs this
        return _train_in_launched_job(project, make_run, topology, args)
    run_dir = make_run()
    try:
        print(run_dir, flush=True)
        logger.info("run directory: %s", run_dir)
        with claimed_new_run(run_dir):
            code = launch_training(
                project,
                run_dir,
                nproc,
                torchrun_args=torchrun_args,
                nodes=nodes,
                allow=args.allow or [],
                verbose=args.verbose,
                max_restarts=max_restarts,
                here=Here("train", name, run_dir / "config.yaml") if nodes.multinode else None,
            )
    except TrainingInterrupted as stop:  # stopped before the job was launched
        code = 128 + stop.signum
    if code == EXIT_USAGE:
        discard_if_unstarted(run_dir)
    elif code in stopped_codes() and discard_unstarted_run(run_dir):
        logger.info("removed %s: stopped before it started training", run_dir)
    return requeue_after_stop(run_dir, code, args.requeue)


def _train_in_launched_job(project, make_run, topology, args: argparse.Namespace) -> int:
    """``accelerate launch -m forge.cli train ...``: rank 0 creates the run, each rank trains."""
    from forge.launch.torchrun import share_from_rank_0
    from forge.launch.worker import run_worker
    from forge.runs import claim_run, discard_unstarted_run
    from forge.train.dist import barrier

    run_dir = share_from_rank_0(make_run if topology.is_main else None)
    lock = None
    if topology.is_main:
        print(run_dir, flush=True)
        logger.info("run directory: %s (rank 0 of %d)", run_dir, topology.world_size)
        lock = claim_run(run_dir)  # no other launcher holds a run created a moment ago
    try:
        code = run_worker(run_dir, project, allow=args.allow or [])
        barrier()  # every rank is done before rank 0 frees the run for another launcher
        return code
    except Exception as err:
        if topology.is_main and exit_code_for(err) == EXIT_USAGE:
            discard_unstarted_run(run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()


def cmd_resume(args: argparse.Namespace) -> int:
    topology = Topology.from_env()
    if not topology.distributed:
        return _resume(args)
    from forge.launch.torchrun import launched_job_group

    # as cmd_train: one process group for every rank of a job another launcher started
    with launched_job_group(topology):
        return _resume_launched_job(args, topology)


def _resume(args: argparse.Namespace) -> int:
    from forge.launch.scheduler import check_requeue, use_stop_signal
    from forge.launch.torchrun import resolve_max_restarts
    from forge.train.signals import stop_while_starting

    use_stop_signal(args.stop_signal)
    stop_while_starting()  # a stop before the loop ends the job cleanly (no step to save)
    check_requeue(args.requeue)
    project = _project(args)
    max_restarts = resolve_max_restarts(args.max_restarts)
    nodes, torchrun_args = _nodes(args)
    args.torchrun_args = torchrun_args
    if nodes.multinode:
        from forge.launch.cluster import check_host

        check_host(nodes)  # before anything starts: a host that never resolves is named here
    if not nodes.creates_run:  # node 0 finds, claims and resolves the run; --set is its too
        from forge.launch.endpoint import Here
        from forge.launch.torchrun import resolve_nproc

        nproc = resolve_nproc(args.nproc, default=_recorded_nproc(project, args, nodes.nnodes))
        return _join(args, project, nproc, nodes, torchrun_args, max_restarts, Here("resume"))
    return _resume_run(args, project, _run_to_resume(args, project), max_restarts, nodes)


def _run_to_resume(args: argparse.Namespace, project: Project) -> Path:
    """The run ``forge resume`` names: ``--run N`` (of ``--config``), ``--run-dir``, or the
    project's newest."""
    from forge.runs import find_run

    config = project.resolve_config_name(args.config) if args.config else None
    return find_run(
        project.output_dir,
        number=args.run,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        config_name=config,
    )


def _resume_run(args, project: Project, run_dir: Path, max_restarts: int, nodes, here=None) -> int:
    """Claim ``run_dir`` and resume it (``forge resume``, or a job SLURM requeued: ``here``,
    what the other nodes of the job were started to run)."""
    from forge.launch.scheduler import requeue_after_stop
    from forge.runs import claim_run, stale_running_note

    stale = stale_running_note(run_dir)
    with claim_run(run_dir):  # refused while the run trains
        if stale:
            logger.warning("%s", stale)
        code = _resume_claimed(args, project, run_dir, max_restarts, nodes, here)
    return requeue_after_stop(run_dir, code, args.requeue)


def _resume_launched_job(args: argparse.Namespace, topology: Topology) -> int:
    """``accelerate launch -m forge.cli resume ...`` (or a user's torchrun of it): rank 0 finds,
    claims and plans the resume as ``forge resume`` does and every rank learns the run and the
    checkpoint; every rank checks the config against a job of this many processes (the checks
    run the trainer's paths, collectives included), then trains from the checkpoint."""
    from forge.launch.scheduler import use_stop_signal
    from forge.launch.start import check_resume_fits, plan_resume, recorded_resume
    from forge.launch.torchrun import resolve_max_restarts, share_from_rank_0
    from forge.launch.worker import run_worker
    from forge.runs import claim_run, parse_run_config, stale_running_note
    from forge.train.dist import barrier
    from forge.train.signals import stop_while_starting

    use_stop_signal(args.stop_signal)
    stop_while_starting()  # a stop before the loop ends the job cleanly (no step to save)
    project = _project(args)
    _refuse_launcher_options(args, topology, resolve_max_restarts(args.max_restarts))
    allow, overrides = args.allow or [], args.set or []
    planned = []  # rank 0's plan, with the checkpoint it validated and hashed

    def plan() -> tuple[Path, str | None]:
        run_dir = _run_to_resume(args, project)
        stale = stale_running_note(run_dir)
        held.enter_context(claim_run(run_dir))  # refused while the run trains
        if stale:
            logger.warning("%s", stale)
        from_checkpoint = Path(args.from_checkpoint).resolve() if args.from_checkpoint else None
        resume = plan_resume(
            project, run_dir, from_checkpoint=from_checkpoint, overrides=overrides, allow=allow
        )
        planned.append(resume)
        if resume.done:
            logger.info("%s", resume.done)
            return run_dir, None
        return run_dir, str(resume.checkpoint.path)

    with contextlib.ExitStack() as held:  # rank 0's: the run's lock, then the resume's record
        run_dir, checkpoint = share_from_rank_0(plan if topology.is_main else None)
        if checkpoint is None:  # complete: nothing to do
            return EXIT_OK
        # the config as rank 0 planned it (the run's, with --set), before rank 0 records it
        cfg = planned[0].cfg if planned else parse_run_config(run_dir, project, overrides, allow)
        check_resume_fits(run_dir, cfg, project, allow, world_size=topology.world_size)
        if planned:
            held.enter_context(recorded_resume(planned[0], world_size=topology.world_size))
            print(run_dir, flush=True)
            logger.info(
                "resuming %s from %s (rank 0 of %d)",
                run_dir,
                planned[0].checkpoint,
                topology.world_size,
            )
        barrier()  # every rank reads the config rank 0 has recorded
        resume_from = planned[0].checkpoint if planned else checkpoint
        code = run_worker(run_dir, project, resume_from=resume_from, allow=allow)
        barrier()  # every rank is done before rank 0 frees the run for another launcher
        return code


def _recorded_nproc(project: Project, args: argparse.Namespace, nnodes: int) -> int:
    """Processes per node as the run (named, or the newest) was started; 1 if unknown."""
    from forge.runs import RunError, RunRecord, find_run

    try:
        run_dir = find_run(
            project.output_dir,
            number=args.run,
            run_dir=Path(args.run_dir) if args.run_dir else None,
        )
        recorded = int(RunRecord.load(run_dir).data.get("world_size") or 1)
    except (RunError, OSError, ValueError):
        return 1
    return max(recorded // nnodes, 1)


def _resume_claimed(
    args, project: Project, run_dir: Path, max_restarts: int, nodes, here=None
) -> int:
    from forge.launch.endpoint import Here
    from forge.launch.start import (
        check_resume_fits,
        plan_resume,
        recorded_resume,
        recorded_world_size,
    )
    from forge.launch.torchrun import launch_training, resolve_nproc

    plan = plan_resume(
        project,
        run_dir,
        from_checkpoint=Path(args.from_checkpoint).resolve() if args.from_checkpoint else None,
        overrides=args.set or [],
        allow=args.allow or [],
    )
    if plan.done:
        logger.info("%s", plan.done)
        return EXIT_OK
    recorded = recorded_world_size(run_dir)
    nproc = resolve_nproc(args.nproc, default=max(recorded // nodes.nnodes, 1))
    check_resume_fits(run_dir, plan.cfg, project, args.allow or [], world_size=nproc * nodes.nnodes)
    with recorded_resume(plan, world_size=nproc * nodes.nnodes):
        print(run_dir, flush=True)
        logger.info("resuming %s from %s", run_dir, plan.checkpoint)
        return launch_training(
            project,
            run_dir,
            nproc,
            torchrun_args=args.torchrun_args,
            nodes=nodes,
            resume_from=plan.checkpoint,
            allow=args.allow or [],
            verbose=args.verbose,
            max_restarts=max_restarts,
            here=here or Here("resume"),
        )


def cmd_worker(args: argparse.Namespace) -> int:
    from forge.launch.torchrun import stop_with_parent
    from forge.launch.worker import run_worker
    from forge.train.signals import stop_while_starting

    stop_with_parent(signal.SIGKILL)  # a worker whose torchrun is gone stops at once
    stop_while_starting()  # a stop before its loop begins ends this rank cleanly
    project = load_project(Path(args.project).resolve())
    run_dir = Path(args.run_dir) if args.run_dir else None
    resume = args.resume_from
    if args.agree_at:  # a job of several nodes: the run is node 0's to name
        from forge.launch.multinode import agree_on_run

        tell = Path(args.tell_run_dir) if args.tell_run_dir else None
        run_dir, resume = agree_on_run(args.agree_at, run_dir, resume, tell_run_dir=tell)
    if run_dir is None:
        raise UsageError("_worker needs --run-dir, or --agree-at in a job of several nodes")
    return run_worker(run_dir, project, resume_from=resume, allow=args.allow or [])


def cmd_runs(args: argparse.Namespace) -> int:
    from forge.read.run import RunReader
    from forge.runs import RunError, all_run_dirs

    project = _project(args)
    rows, damaged = [], []
    for run_dir in all_run_dirs(project.output_dir):
        name = str(run_dir.relative_to(project.output_dir))
        try:
            run = RunReader(run_dir).summary()
        except RunError as err:
            damaged.append(str(err))
            rows.append([name, "?", "damaged", "", "", "", "", ""])
            continue
        best = f"{run.best[0]}={run.best[1]:.4g}" if run.best else ""
        rows.append(
            [
                name,
                run.config,
                run.status,
                str(run.step),
                str(run.checkpoints),
                best,
                run.created[:19],
                run.stream,
            ]
        )
    if not rows:
        print(f"no runs under {project.output_dir}", file=sys.stderr)
        return EXIT_OK
    header = ["RUN", "CONFIG", "STATUS", "STEP", "CKPTS", "BEST", "CREATED", "STREAM"]
    if not any(row[-1] for row in rows):  # no run reads a stream: no column for it
        header, rows = header[:-1], [row[:-1] for row in rows]
    print(_table(rows, header))
    for message in damaged:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_FAILURE if damaged else EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from forge.launch.job_plan import human_bytes  # binary units, as the plan prints them
    from forge.read.run import RunReader
    from forge.runs import all_run_dirs, find_run

    project = _project(args)
    if args.run is not None or args.run_dir:
        runs = [
            find_run(
                project.output_dir,
                number=args.run,
                run_dir=Path(args.run_dir) if args.run_dir else None,
                choose=lambda matching: f"use --run-dir {matching[0]} (or another of them)",
            )
        ]
    else:
        runs = all_run_dirs(project.output_dir)
    rows, invalid = [], 0
    for run_dir in runs:
        run = RunReader(run_dir)
        for entry in run.checkpoints(verify=args.verify):
            status = "valid" if entry.valid else "INVALID: " + "; ".join(entry.problems)
            invalid += not entry.valid
            rows.append(
                [
                    _shown_path(entry.path, project),
                    str(entry.step),
                    "" if entry.epoch is None else f"{entry.epoch:.2f}",
                    human_bytes(entry.size),
                    entry.kept or "-",
                    status,
                ]
            )
        leftovers = run.leftovers()
        live = bool(leftovers) and run.is_live
        for entry in leftovers:
            status = (
                "being written (the run is training)" if live else f"leftover: {entry.leftover}"
            )
            if not live:
                status += "; never loaded, the next save removes it"
            rows.append(
                [_shown_path(entry.path, project), "", "", human_bytes(entry.size), "", status]
            )
    if not rows:
        print("no checkpoints", file=sys.stderr)
        return EXIT_OK
    print(_table(rows, ["CHECKPOINT", "STEP", "EPOCH", "SIZE", "KEPT", "STATUS"]))
    if not args.verify:
        print("(sizes checked; add --verify to check hashes too)", file=sys.stderr)
    return EXIT_FAILURE if invalid and args.verify else EXIT_OK


def _shown_path(path: Path, project: Project) -> str:
    try:
        return str(path.relative_to(project.output_dir))
    except ValueError:  # a --run-dir outside the project
        return str(path)


def cmd_generate(args: argparse.Namespace) -> int:
    from forge.read.reader import CheckpointReader

    reader = CheckpointReader(args.checkpoint, best=args.best, allow=args.allow or [])
    logger.info("generating from %s", reader.path)
    texts = reader.generate(
        args.prompt,
        num=args.num,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    for index, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {index + 1} ---")
        print(text)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from forge.read.export import loading_hint
    from forge.read.reader import export_model

    output = Path(args.output)
    export_model(  # one call: the checkpoint goes down to the reader and does not come back
        args.checkpoint,
        output,
        force=args.force,
        max_shard_size=args.max_shard_size,
        submodule=args.submodule,
        ema=args.ema,
        merge_lora=args.merge_lora,
    )
    print(output)
    logger.info("%s", loading_hint(output))
    return EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    from forge.read.reader import CheckpointReader

    reader = CheckpointReader(args.checkpoint, best=args.best, allow=args.allow or [], models=False)
    checkpoint = reader.path
    logger.info("evaluating %s on the %s split", checkpoint, args.split)
    metrics = reader.evaluate(args.split, ema=args.ema)
    if not Topology.from_env().is_main:  # under a launcher every rank evaluates its share
        return EXIT_OK
    if args.json:
        print(json.dumps({"checkpoint": str(checkpoint), **metrics}))
        return EXIT_OK
    width = max(len(name) for name in metrics)
    for name, value in metrics.items():
        print(
            f"{name:{width}}  {value:.6g}"
            if isinstance(value, float)
            else f"{name:{width}}  {value}"
        )
    return EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    from forge.read.reader import CheckpointReader

    if args.batch_size < 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1):
        raise UsageError("--batch-size and --max-new-tokens must be positive integers")
    reader = CheckpointReader(args.checkpoint, best=args.best, allow=args.allow or [])
    logger.info("predicting with %s", reader.path)
    count = reader.predict(
        args.input,
        args.output,
        text_field=args.text_field,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    logger.info("wrote %d predictions", count)
    print(args.output)
    return EXIT_OK


def cmd_new(args: argparse.Namespace) -> int:
    from forge.cli.new import new_project

    parent = Path(args.parent or ".")
    target = new_project(args.name, parent, args.template)
    print(target)
    shown = target if parent.is_absolute() else Path(os.path.relpath(target))
    logger.info("created project %s from the %s scaffold; next:", args.name, args.template)
    logger.info("  forge ls -p %s", shown)
    logger.info("  forge train -p %s", shown)
    return EXIT_OK


def cmd_new_config(args: argparse.Namespace) -> int:
    from forge.cli.new import new_config

    project = _project(args)
    path = new_config(project, args.name, args.extends)
    print(path)
    name = path.relative_to(project.configs_dir).with_suffix("").as_posix()
    where = f" -p {args.project}" if args.project else ""
    logger.info("created %s; see what it renders to: forge render %s%s", path, name, where)
    return EXIT_OK


def cmd_code(args: argparse.Namespace) -> int:
    from forge.config.codegen import generate_script
    from forge.config.graph import CallNode
    from forge.launch.length_note import moot_arguments

    project = _project(args)
    name, cfg = _load(args, project)
    if args.target not in cfg.targets:
        raise UsageError(
            f"config '{name}' has no target {args.target!r}; targets: "
            + ", ".join(cfg.public_targets)
        )
    words = ["forge", "code", name, "-p", str(project.root)]
    for define in args.define or []:
        words += ["-D", define]
    for override in args.set or []:
        words += ["--set", override]
    if args.target != "trainer":
        words += ["--target", args.target]
    trainer = cfg.targets.get("trainer")
    trainer_args = trainer.kwargs.get("args") if isinstance(trainer, CallNode) else None
    moot = {name for name, _ in moot_arguments(cfg)}  # values that change nothing: not written
    script = generate_script(
        cfg.targets,
        target=args.target,
        project_root=project.root,
        config_name=name,
        command=shlex.join(words),
        script_name=Path(args.output).name if args.output else "train.py",
        omit={id(trainer_args): moot} if moot and trainer_args is not None else None,
    )
    compile(script, args.output or "<forge code>", "exec")  # a generator bug fails here, not later
    if not args.output:
        sys.stdout.write(script)
        return EXIT_OK
    output = Path(args.output)
    output.write_text(script)
    output.chmod(output.stat().st_mode | 0o111)
    logger.info("wrote %s; run it with: python %s --output-dir DIR", output, output)
    return EXIT_OK


def _run_dir(project: Project, run: str | None, command: str) -> Path:
    """RUN as a run directory, a path under the project's output, a run number, or the newest."""
    from forge.runs import find_run

    if run is None:
        return find_run(project.output_dir)
    for candidate in (Path(run), project.output_dir / run):
        if (candidate / "run.json").is_file():
            return candidate.resolve()
    if run.isdigit():

        def choose(matching: list[Path]) -> str:
            under = matching[0].relative_to(project.output_dir).as_posix()
            return f"name it by its path under output/: forge {command} {under} (or another)"

        return find_run(project.output_dir, number=int(run), choose=choose)
    raise UsageError(
        f"RUN {run!r} is neither a run directory, a path under {project.output_dir} "
        "(e.g. train/run_001) nor a run number; `forge runs` lists them"
    )


def cmd_plot(args: argparse.Namespace) -> int:
    from forge.cli.plot import save_plot

    project = _project(args)
    run_dir = _run_dir(project, args.run, "plot")
    metrics = [m.strip() for m in args.metric.split(",") if m.strip()] if args.metric else None
    output = Path(args.output) if args.output else run_dir / "metrics.png"
    print(save_plot(run_dir, metrics, output))
    return EXIT_OK


def cmd_tb(args: argparse.Namespace) -> int:
    from forge.cli.plot import require_tensorboard, tensorboard_command
    from forge.runs import RunError

    project = _project(args)
    logdir = _run_dir(project, args.run, "tb") if args.run else project.output_dir
    if not logdir.is_dir():
        raise RunError(f"no runs under {logdir}; start one with `forge train CONFIG`")
    command = tensorboard_command(logdir, port=args.port, host=args.host)
    if args.print_command:
        print(shlex.join(command))
        return EXIT_OK
    require_tensorboard()
    logger.info("serving %s: %s", logdir, shlex.join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)  # TensorBoard takes over this process and its Ctrl-C


def cmd_sweep(args: argparse.Namespace) -> int:
    from forge.cli.sweep import cmd_sweep as sweep

    return sweep(args)


def cmd_env(args: argparse.Namespace) -> int:
    from forge.cli.env import environment_report

    for key, value in environment_report():
        print(f"{key + ':':24s} {value}")
    return EXIT_OK


COMMANDS = {
    "ls": cmd_ls,
    "render": cmd_render,
    "vars": cmd_vars,
    "build": cmd_build,
    "train": cmd_train,
    "resume": cmd_resume,
    "runs": cmd_runs,
    "checkpoints": cmd_checkpoints,
    "generate": cmd_generate,
    "export": cmd_export,
    "evaluate": cmd_evaluate,
    "predict": cmd_predict,
    "new": cmd_new,
    "new-config": cmd_new_config,
    "code": cmd_code,
    "plot": cmd_plot,
    "tb": cmd_tb,
    "sweep": cmd_sweep,
    "env": cmd_env,
    "_worker": cmd_worker,
}
