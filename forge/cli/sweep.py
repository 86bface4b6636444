"""``forge sweep``: a search over a config's template variables, every trial an ordinary run.

``forge sweep CONFIG -D NAME=AXIS ...`` checks everything first (the variables the config
reads, the ranges, the objective and its direction), then trains the trials: a grid, a random
search, or an Optuna study (TPE by default). ``forge sweep show`` prints the trials sorted by
objective and names the best trial's run; ``forge sweep plot`` draws them. The search space
and the sweep's state live in forge.sweep; this module reads the command line and the sweep
file, and prints.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from forge.cli.exits import EXIT_OK, UsageError
from forge.config import ConfigError, Project, find_project, load_config, load_project, parse_define
from forge.suggest import suggestion
from forge.sweep.space import (
    Axis,
    SweepSpec,
    SweepUsageError,
    direction_for,
    parse_axis,
)

logger = logging.getLogger("forge")

FILE_KEYS = ("config", "method", "trials", "objective", "direction", "seed", "pruner", "axes")
FILE_KEYS += ("fixed", "name", "jobs")
DEFAULT_TRIALS = 10
# what every forge run logs, whatever its config: training's and the summary's metrics
TRAIN_METRICS = ("loss", "train_loss", "grad_norm", "learning_rate")


def cmd_sweep(args: argparse.Namespace) -> int:
    words = list(args.words or [])
    if words and words[0] in ("show", "plot"):
        if len(words) > 2:
            raise UsageError(f"forge sweep {words[0]} takes one NAME at most (got {words[1:]})")
        name = words[1] if len(words) > 1 else args.name
        return show_sweep(args, name) if words[0] == "show" else plot_sweep(args, name)
    if len(words) > 1:
        raise UsageError(
            f"forge sweep takes one CONFIG (got {' '.join(words)}); axes go in -D NAME=VALUES"
        )
    return run_sweep(args, words[0] if words else None)


# --------------------------------------------------------------------------- the spec


def _project(args: argparse.Namespace) -> Project:
    return load_project(Path(args.project)) if args.project else find_project(Path.cwd())


def read_sweep_file(project: Project, text: str) -> dict[str, Any]:
    """A sweep file: a path, or NAME for the project's ``templates/sweeps/NAME.yaml``."""
    candidates = [Path(text), project.root / "templates" / "sweeps" / text]
    candidates.append(candidates[-1].with_name(candidates[-1].name + ".yaml"))
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise UsageError(f"--file {text}: no such file (nor templates/sweeps/{text}.yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a sweep file is a mapping of {', '.join(FILE_KEYS)}")
    unknown = [k for k in data if k not in FILE_KEYS]
    if unknown:
        raise UsageError(
            f"{path}: unknown key {unknown[0]!r}"
            + suggestion(unknown[0], FILE_KEYS)
            + f" (keys: {', '.join(FILE_KEYS)})"
        )
    for key in ("axes", "fixed"):
        if not isinstance(data.get(key) or {}, dict):
            raise UsageError(f"{path}: {key} must map variable names to values")
    return data


def build_spec(args: argparse.Namespace, project: Project) -> tuple[SweepSpec, dict[str, Any]]:
    """The sweep's spec from the sweep file and the command line (which wins), and the options
    that do not name the study (trials, jobs, name)."""
    data = read_sweep_file(project, args.file) if args.file else {}
    config = args.config or data.get("config") or project.default_config
    if not config:
        raise UsageError("no CONFIG given and meta.yaml names no default_config")
    config = project.resolve_config_name(str(config))
    axes: dict[str, Axis] = {}
    fixed: dict[str, Any] = {}
    raw = [(k, v) for k, v in (data.get("axes") or {}).items()]
    raw += [(k, v) for k, v in (data.get("fixed") or {}).items()]
    for item in args.define or []:
        name, _, text = item.partition("=")
        parse_define(item)  # NAME=VALUE's own checks
        raw.append((name.strip(), text))
    for name, value in raw:
        axis = parse_axis(name, value)
        if axis is None:
            fixed[name] = parse_define(f"{name}={value}")[1] if isinstance(value, str) else value
            axes.pop(name, None)
        else:
            axes[name] = axis
            fixed.pop(name, None)
    method = args.method or data.get("method")
    if method is None:
        method = "grid" if all(a.is_list for a in axes.values()) else "tpe"
    objective = args.objective or data.get("objective") or "eval_loss"
    direction = args.direction or data.get("direction")  # checked with the objective
    pruner = (
        args.pruner
        or data.get("pruner")
        or ("median" if method not in ("grid", "random") else "none")
    )
    seed = args.seed if args.seed is not None else int(data.get("seed", 0))
    spec = SweepSpec(
        config=config,
        axes=list(axes.values()),
        fixed=fixed,
        method=str(method),
        objective=str(objective),
        direction=direction,
        seed=seed,
        pruner=str(pruner),
    )
    spec.check()
    if spec.method == "grid":
        trials = len(spec.grid())
        asked = args.trials or data.get("trials")
        if asked is not None and int(asked) != trials:
            raise SweepUsageError(f"--trials {asked}: a grid has {trials} points; leave it out")
    else:
        trials = int(args.trials or data.get("trials") or DEFAULT_TRIALS)
    if trials < 1:
        raise SweepUsageError(f"--trials must be a positive integer (got {trials})")
    jobs = int(args.jobs or data.get("jobs") or 1)
    if jobs < 1:
        raise SweepUsageError(f"--jobs must be a positive integer (got {jobs})")
    return spec, {"trials": trials, "jobs": jobs, "name": args.name or data.get("name")}


def check_before_any_trial(spec: SweepSpec, project: Project, args: argparse.Namespace):
    """Render and check the config at the sweep's points (every grid point; a study's first
    draw), the sampler and the pruner, and the objective: all before any trial runs."""
    if spec.uses_optuna:
        from forge.sweep.study import make_pruner, make_sampler

        make_sampler(spec)
        make_pruner(spec.pruner)
    elif spec.pruner != "none":
        raise SweepUsageError(
            f"--pruner {spec.pruner}: pruning needs a study (--method tpe or another Optuna "
            "sampler); a grid or random search trains every trial to its end"
        )
    points = spec.grid() if spec.method == "grid" else [_probe(spec)]
    cfg = None
    for index, values in enumerate(points):
        cfg = load_config(
            project,
            spec.config,
            variables={**spec.fixed, **values},
            overrides=args.set or [],
            allow=args.allow or [],
        )
        if index == 0:
            problems = cfg.check()
            if problems:
                raise ConfigError(problems, config=spec.config)
            check_objective(cfg, spec)
            spec.direction = direction_for(spec.objective, spec.direction)
        if "trainer" not in cfg.targets:
            raise UsageError(f"config '{spec.config}' has no 'trainer' target; nothing to train")
    return cfg


def _probe(spec: SweepSpec) -> dict[str, Any]:
    """A point of a study's space (each range's lower bound, each list's first value)."""
    values = {}
    for axis in spec.axes:
        values[axis.name] = axis.values[0] if axis.is_list else axis.low
    return values


def check_objective(cfg, spec: SweepSpec) -> None:
    """The objective must be a metric the config's training logs: a training metric, or an
    evaluation's (the config evaluates; other than eval_loss only with compute_metrics)."""
    from forge.config.graph import CallNode

    trainer = cfg.targets.get("trainer")
    kwargs = trainer.kwargs if isinstance(trainer, CallNode) else {}
    trainer_args = kwargs.get("args")
    targs = trainer_args.kwargs if isinstance(trainer_args, CallNode) else {}
    evaluates = kwargs.get("eval_dataset") is not None and targs.get("eval_strategy", "no") != "no"
    known = list(TRAIN_METRICS) + (["eval_loss"] if evaluates else [])
    metric = spec.objective
    if metric in known:
        return
    if evaluates and metric.startswith("eval_") and kwargs.get("compute_metrics") is not None:
        return  # compute_metrics' names are known once it runs; a trial that lacks it stops
    why = (
        "the config does not evaluate (no eval_dataset, or eval_strategy: no)"
        if metric.startswith("eval_") and not evaluates
        else "its evaluation logs eval_loss only (add compute_metrics for others)"
        if evaluates and metric.startswith("eval_")
        else "it is not a metric forge logs"
    )
    raise SweepUsageError(
        f"--objective {metric}: {why}; metrics: {', '.join(known)}" + suggestion(metric, known)
    )


# --------------------------------------------------------------------------- running


def run_sweep(args: argparse.Namespace, config: str | None) -> int:
    from forge.runs import config_output_dir, create_run
    from forge.sweep.runner import Sweeper
    from forge.sweep.study import open_sweep

    args.config = config
    project = _project(args)
    spec, options = build_spec(args, project)
    check_before_any_trial(spec, project, args)
    if args.dry_run:
        return print_plan(spec, options, project, args)
    sweep = open_sweep(project.output_dir, spec, options["name"], options["trials"])
    done = [r for r in sweep.records() if r["status"] in ("completed", "pruned", "failed")]
    logger.info(
        "sweep %s: %d of %d trials done; %s of %s over %s (state: %s)",
        sweep.name,
        len(done),
        sweep.trials,
        spec.method,
        spec.objective,
        ", ".join(a.name for a in spec.axes),
        sweep.directory,
    )

    def make_run(values: dict[str, Any], field: dict[str, Any]) -> Path:
        variables = {**spec.fixed, **values}
        cfg = load_config(
            project,
            spec.config,
            variables=variables,
            overrides=args.set or [],
            allow=args.allow or [],
        )
        return create_run(
            config_output_dir(project.output_dir, spec.config),
            config_name=spec.config,
            config_text=cfg.text,
            project_root=project.root,
            overrides=args.set or [],
            variables=variables,
            nproc=1,
            fields={"sweep": field},
        )

    sweeper = Sweeper(
        sweep,
        project.root,
        make_run,
        jobs=options["jobs"],
        max_trials_here=1 if args.one_trial else None,
        allow=args.allow or [],
    )
    code = sweeper.run()
    best = link_best(sweep.directory, spec)
    records = sweep.records()
    counts = {s: sum(r["status"] == s for r in records) for s in ("completed", "pruned", "failed")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no trial ended"
    logger.info("sweep %s: %d of %d trials (%s)", sweep.name, len(records), sweep.trials, summary)
    if best is not None:
        logger.info(
            "best: trial %d, %s=%.6g, %s",
            best["trial"],
            spec.objective,
            best["value"],
            best["run_dir"],
        )
    print(sweep.directory, flush=True)
    if code == 0:
        refuse_all_failed(sweep.name, records, sweeper.trained_here)
    return code


def refuse_all_failed(name: str, records: list[dict], trained_here: list[dict]) -> None:
    """A RuntimeFailure (exit 1) when no trial of the sweep completed and some failed, or every
    trial this process trained failed (a SLURM array task's one trial): a script that goes on
    to ``forge export SWEEP/best`` stops here."""
    from forge.cli.exits import RuntimeFailure

    failed = [r for r in records if r["status"] == "failed"]
    mine = [r for r in trained_here if r["status"] == "failed"]
    if failed and not any(r["status"] == "completed" for r in records):
        what = f"every trial of sweep {name} that ended failed ({len(failed)} of {len(records)})"
        first = failed[0]
    elif trained_here and len(mine) == len(trained_here):
        what = f"the trial(s) this process trained failed ({len(mine)})"
        first = mine[0]
    else:
        return
    raise RuntimeFailure(
        f"{what}; trial {first['trial']}: {first.get('error') or 'the run failed'} "
        f"({first.get('run_dir')}). `forge sweep show {name}` lists every trial's error; "
        "fix the config and start a sweep under another --name"
    )


def link_best(directory: Path, spec_or_data) -> dict[str, Any] | None:
    """Point ``SWEEP/best`` at the best completed trial's run (``forge export SWEEP/best``)."""
    from forge.runs import link_best_checkpoint
    from forge.sweep.study import Sweep

    direction = spec_or_data.direction
    sweep = Sweep(Path(directory), None, Path(directory).name, 0)  # type: ignore[arg-type]
    ranked = rank(sweep.records(), direction)
    best = ranked[0] if ranked and ranked[0]["status"] == "completed" else None
    if best is not None and best.get("run_dir"):
        link_best_checkpoint(Path(directory), Path(best["run_dir"]))
    return best


def rank(records: list[dict[str, Any]], direction: str) -> list[dict[str, Any]]:
    """Completed trials by objective (best first), then pruned ones, running, failed."""
    order = {"completed": 0, "pruned": 1, "running": 2, "failed": 3}
    sign = -1.0 if direction == "maximize" else 1.0

    def key(record):
        value = record.get("value")
        number = sign * value if isinstance(value, (int, float)) else math.inf
        return (order.get(record["status"], 4), number, record["trial"])

    return sorted(records, key=key)


# --------------------------------------------------------------------------- dry run


def print_plan(spec: SweepSpec, options: dict, project: Project, args) -> int:
    from forge.sweep.study import default_name

    name = options["name"] or default_name(spec)
    trials, _jobs = options["trials"], options["jobs"]
    print(
        f"sweep {name} of config {spec.config}: {trials} trial(s), {spec.method}, "
        f"{spec.direction} {spec.objective}"
        + (f", pruner {spec.pruner}" if spec.uses_optuna else "")
    )
    print(f"  state: {project.output_dir / 'sweeps' / name}/")
    print(
        f"  runs:  {project.output_dir / Path(spec.config).with_suffix('')}/run_NNN/ (one per trial)"
    )
    if spec.fixed:
        print("  fixed: " + " ".join(f"{k}={v}" for k, v in spec.fixed.items()))
    for axis in spec.axes:
        print(f"  axis {axis.name}: {axis.describe()}")
    if spec.uses_optuna:
        print(f"  trials are drawn by the study as earlier ones finish ({spec.method})")
    else:
        print("trials:")
        width = max(len(str(trials - 1)), 1)
        for number in range(trials):
            values = spec.trial_values(number)
            print(f"  {number:>{width}}  " + " ".join(f"{k}={_fmt(v)}" for k, v in values.items()))
    print()
    print("# SLURM: one trial per array task, each a worker of the same study (sbatch this)")
    print(slurm_script(name, spec, options, project, args))
    return EXIT_OK


def slurm_script(name: str, spec: SweepSpec, options: dict, project: Project, args) -> str:
    words = ["forge", "sweep", spec.config, "-p", str(project.root), "--name", name]
    if args.file:
        words += ["--file", args.file]
    for item in args.define or []:
        words += ["-D", item]
    for item in args.set or []:
        words += ["--set", item]
    for flag, value in (
        ("--method", args.method),
        ("--objective", args.objective),
        ("--direction", args.direction),
        ("--pruner", args.pruner),
        ("--seed", args.seed),
    ):
        if value is not None:
            words += [flag, str(value)]
    words += ["--trials", str(options["trials"])] if not spec.method == "grid" else []
    words.append("--one-trial")
    logs = project.output_dir / "sweeps" / name
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name=forge-sweep-{name}",
            f"#SBATCH --array=0-{options['trials'] - 1}%{options['jobs']}",
            "#SBATCH --ntasks=1",
            "#SBATCH --gpus-per-task=1",
            f"#SBATCH --output={logs}/slurm-%A_%a.out",
            f"mkdir -p {shlex.quote(str(logs))}",
            shlex.join(words),
        ]
    )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- show and plot


def _sweep_dir(args: argparse.Namespace, name: str | None) -> tuple[Project, Path, dict]:
    from forge.sweep.study import find_sweep, read_sweep_file

    project = _project(args)
    directory = find_sweep(project.output_dir, name)
    return project, directory, read_sweep_file(directory)


class _Direction:
    def __init__(self, direction: str) -> None:
        self.direction = direction


def show_sweep(args: argparse.Namespace, name: str | None) -> int:
    from forge.runs import RunError, RunRecord, run_is_live
    from forge.sweep.study import Sweep

    project, directory, data = _sweep_dir(args, name)
    spec = data["spec"]
    sweep = Sweep(directory, None, directory.name, data.get("trials", 0))  # type: ignore[arg-type]
    records = rank(sweep.records(), spec["direction"])
    names = list(spec["axes"])
    objective = spec["objective"]
    rows = []
    for record in records:
        status = record["status"]
        run = record.get("run_dir")
        if status == "running" and run and not run_is_live(Path(run)):
            status = "interrupted"  # its sweep was stopped; the same command resumes it
        step = record.get("step")
        if step is None and run:
            try:
                step = RunRecord.load(Path(run)).data.get("step")
            except RunError:
                step = None
        value = record.get("value")
        rows.append(
            [str(record["trial"]), _fmt(value) if value is not None else "-", status]
            + [_fmt(record["params"].get(n)) for n in names]
            + [str(step if step is not None else ""), _shown(run, project)]
        )
    print(
        f"sweep {directory.name}: config {data['config']}, {spec['method']}, "
        f"{spec['direction']} {objective}; {len(records)} of {data.get('trials')} trials"
    )
    if not rows:
        print("(no trials yet)")
        return EXIT_OK
    from forge.cli.table import table

    print(table(rows, ["TRIAL", objective.upper(), "STATUS", *names, "STEP", "RUN"]))
    best = link_best(directory, _Direction(spec["direction"]))
    if best is not None:
        shown = _shown(best["run_dir"], project)
        print(
            f"best: trial {best['trial']} ({objective}={best['value']:.6g}), run {shown}; "
            f"export it with: forge export {_shown(str(directory / 'best'), project)} OUT"
        )
    for record in records:
        if record["status"] == "failed" and record.get("error"):
            print(f"trial {record['trial']} failed: {record['error']}", file=sys.stderr)
    return EXIT_OK


def _shown(path: str | None, project: Project) -> str:
    if not path:
        return ""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def plot_sweep(args: argparse.Namespace, name: str | None) -> int:
    from forge.cli.plot import _pyplot
    from forge.sweep.study import Sweep

    project, directory, data = _sweep_dir(args, name)
    spec = data["spec"]
    sweep = Sweep(directory, None, directory.name, 0)  # type: ignore[arg-type]
    records = [r for r in sweep.records() if isinstance(r.get("value"), (int, float))]
    if not records:
        raise UsageError(f"sweep {directory.name} has no trial with an objective yet")
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator, NullFormatter

    names = list(spec["axes"])
    figure, axes = plt.subplots(
        1, 1 + len(names), figsize=(4.5 * (1 + len(names)), 4), layout="constrained", squeeze=False
    )
    axes = axes[0]
    objective, maximize = spec["objective"], spec["direction"] == "maximize"
    done = [r for r in records if r["status"] == "completed"]
    pruned = [r for r in records if r["status"] == "pruned"]
    axes[0].scatter([r["trial"] for r in done], [r["value"] for r in done], label="completed")
    if pruned:
        axes[0].scatter(
            [r["trial"] for r in pruned],
            [r["value"] for r in pruned],
            marker="x",
            label="pruned (at its last evaluation)",
        )
    best, line = None, []
    for record in sorted(done, key=lambda r: r["trial"]):
        value = record["value"]
        best = value if best is None else (max(best, value) if maximize else min(best, value))
        line.append((record["trial"], best))
    if line:
        axes[0].step(*zip(*line, strict=True), where="post", color="0.4", label="best so far")
    axes[0].set_xlabel("trial")
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel(objective)
    axes[0].legend()
    axes[0].set_title(f"sweep {directory.name}")
    for ax, variable in zip(axes[1:], names, strict=True):
        points = [(r["params"].get(variable), r["value"]) for r in done]
        categorical = any(not isinstance(x, (int, float)) for x, _ in points)
        xs = [str(x) for x, _ in points] if categorical else [x for x, _ in points]
        ax.scatter(xs, [v for _, v in points])
        if spec["axes"][variable].startswith("loguniform") or ",log)" in spec["axes"][variable]:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # labels at the decades only
        ax.set_xlabel(variable)
        ax.set_ylabel(objective)
    for ax in axes:
        ax.grid(alpha=0.3)
    output = Path(args.output) if args.output else directory / "sweep.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    print(output)
    return EXIT_OK


__all__ = ["cmd_sweep"]
