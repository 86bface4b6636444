"""One thin function per ``forge`` command: read the arguments, call the part that does the
work, print the result. Each returns the exit code.

Heavy modules are imported inside the commands that need them, so ``forge ls`` or
``forge render`` never load torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from forge.config import ConfigError, Project, find_project, load_config, load_project
from forge.config import parse_define as _parse_define
from forge.errors import EXIT_USAGE, UsageError, exit_code_for

logger = logging.getLogger("forge")

EXIT_OK, EXIT_FAILURE = 0, 1


# --------------------------------------------------------------------------- helpers


def _project(args: argparse.Namespace) -> Project:
    if getattr(args, "project", None):
        return load_project(Path(args.project).resolve())
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


def _table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _human_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}TB"


# --------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    project = _project(args)
    rows, broken = [], []
    for name in project.list_configs():
        try:
            cfg = load_config(project, name, variables=_defines(args), allow=args.allow or [])
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
    else:
        sys.stdout.write(cfg.text if cfg.text.endswith("\n") else cfg.text + "\n")
    return EXIT_OK


def cmd_build(args: argparse.Namespace) -> int:
    from forge.worker import build_variables

    project = _project(args)
    name, cfg = _load(args, project)
    variables = build_variables(Path(args.run_dir or project.output_dir / "build"), project, name)
    obj = cfg.build(args.target, variables)
    print(repr(obj))
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from forge.launch import launch_training, resolve_nproc
    from forge.runs import config_output_dir, create_run, discard_unstarted_run

    project = _project(args)
    name, cfg = _load(args, project)
    nproc = resolve_nproc(args.nproc)
    if "trainer" not in cfg.targets:
        raise UsageError(f"config '{name}' has no 'trainer' target; nothing to train")
    if args.dry_run:
        print(f"config {name} renders and checks; would train with {nproc} process(es) in")
        print(f"  {config_output_dir(project.output_dir, name)}/run_NNN/")
        return EXIT_OK
    run_dir = create_run(
        config_output_dir(project.output_dir, name),
        config_name=name,
        config_text=cfg.text,
        project_root=project.root,
        overrides=args.set or [],
        variables=_defines(args),
        nproc=nproc,
    )
    print(run_dir, flush=True)
    logger.info("run directory: %s", run_dir)
    try:
        code = launch_training(
            project,
            run_dir,
            nproc,
            torchrun_args=args.torchrun_args,
            allow=args.allow or [],
            verbose=args.verbose,
        )
    except Exception as err:
        if exit_code_for(err) == EXIT_USAGE and discard_unstarted_run(run_dir):
            logger.info("removed %s: the run never started", run_dir)
        raise
    if code == EXIT_USAGE and discard_unstarted_run(run_dir):
        logger.info("removed %s: the run never started", run_dir)
    return code


def cmd_resume(args: argparse.Namespace) -> int:
    from forge.launch import launch_training, resolve_nproc
    from forge.runs import (
        RunRecord,
        apply_config_overrides,
        find_resume_checkpoint,
        find_run,
        record_resume,
    )

    project = _project(args)
    config = project.resolve_config_name(args.config) if args.config else None
    run_dir = find_run(
        project.output_dir,
        number=args.run,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        config_name=config,
    )
    from_checkpoint = Path(args.from_checkpoint) if args.from_checkpoint else None
    checkpoint = find_resume_checkpoint(run_dir, from_checkpoint)
    recorded = int(RunRecord.load(run_dir).data.get("world_size") or 1)
    nproc = resolve_nproc(args.nproc, default=recorded)
    overrides = args.set or []
    apply_config_overrides(run_dir, project, overrides, args.allow or [])
    record_resume(run_dir, checkpoint, overrides=overrides, world_size=nproc)
    print(run_dir, flush=True)
    logger.info("resuming %s from %s", run_dir, checkpoint)
    return launch_training(
        project,
        run_dir,
        nproc,
        torchrun_args=args.torchrun_args,
        resume_from=str(checkpoint),
        allow=args.allow or [],
        verbose=args.verbose,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from forge.worker import run_worker

    project = load_project(Path(args.project).resolve())
    resume = args.resume_from
    return run_worker(Path(args.run_dir), project, resume_from=resume, allow=args.allow or [])


def cmd_runs(args: argparse.Namespace) -> int:
    from forge.runs import RunRecord, all_run_dirs

    project = _project(args)
    rows = []
    for run_dir in all_run_dirs(project.output_dir):
        data = RunRecord.load(run_dir).data
        best = data.get("best") or {}
        best_text = ""
        if best.get("metric") and best.get("value") is not None:
            best_text = f"{best['metric']}={best['value']:.4g}"
        rows.append(
            [
                str(run_dir.relative_to(project.output_dir)),
                data.get("config", "?"),
                data.get("status", "?"),
                str(data.get("step", 0)),
                str(len(data.get("checkpoints", []))),
                best_text,
                data.get("created", "")[:19],
            ]
        )
    if not rows:
        print(f"no runs under {project.output_dir}", file=sys.stderr)
        return EXIT_OK
    print(_table(rows, ["RUN", "CONFIG", "STATUS", "STEP", "CKPTS", "BEST", "CREATED"]))
    return EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from forge.checkpoint.layout import find_checkpoints
    from forge.runs import all_run_dirs, find_run

    project = _project(args)
    if args.run is not None or args.run_dir:
        runs = [
            find_run(
                project.output_dir,
                number=args.run,
                run_dir=Path(args.run_dir) if args.run_dir else None,
            )
        ]
    else:
        runs = all_run_dirs(project.output_dir)
    rows, invalid = [], 0
    for run_dir in runs:
        for info in find_checkpoints(run_dir / "checkpoints", verify_hashes=args.verify):
            size = sum(f.stat().st_size for f in info.path.rglob("*") if f.is_file())
            epoch = info.manifest.epoch if info.manifest else None
            status = "valid" if info.valid else "INVALID: " + "; ".join(info.problems)
            invalid += not info.valid
            rows.append(
                [
                    str(info.path.relative_to(project.output_dir)),
                    str(info.step),
                    "" if epoch is None else f"{epoch:.2f}",
                    _human_size(size),
                    status,
                ]
            )
    if not rows:
        print("no checkpoints", file=sys.stderr)
        return EXIT_OK
    print(_table(rows, ["CHECKPOINT", "STEP", "EPOCH", "SIZE", "STATUS"]))
    if not args.verify:
        print("(sizes checked; add --verify to check hashes too)", file=sys.stderr)
    return EXIT_FAILURE if invalid and args.verify else EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    from forge.generate import generate_text, resolve_checkpoint

    checkpoint = resolve_checkpoint(Path(args.checkpoint), best=args.best)
    logger.info("generating from %s", checkpoint)
    texts = generate_text(
        checkpoint,
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


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    from forge.generate import resolve_checkpoint
    from forge.predict import evaluate_checkpoint

    checkpoint = resolve_checkpoint(Path(args.checkpoint), best=args.best)
    logger.info("evaluating %s on the %s split", checkpoint, args.split)
    metrics = evaluate_checkpoint(checkpoint, args.split, args.allow or [])
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
    from forge.generate import resolve_checkpoint
    from forge.predict import predict_file

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UsageError("--batch-size and --max-new-tokens must be positive integers")
    checkpoint = resolve_checkpoint(Path(args.checkpoint), best=args.best)
    logger.info("predicting with %s", checkpoint)
    count = predict_file(
        checkpoint,
        Path(args.input),
        Path(args.output),
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
    from forge.scaffold import new_project

    parent = Path(args.parent or ".")
    target = new_project(args.name, parent, args.template)
    print(target)
    shown = target if parent.is_absolute() else Path(os.path.relpath(target))
    logger.info("created project %s from the %s scaffold; next:", args.name, args.template)
    logger.info("  forge ls -p %s --check", shown)
    logger.info("  forge train -p %s", shown)
    return EXIT_OK


def cmd_new_config(args: argparse.Namespace) -> int:
    from forge.scaffold import new_config

    project = _project(args)
    path = new_config(project, args.name, args.extends)
    print(path)
    name = path.relative_to(project.configs_dir).with_suffix("").as_posix()
    where = f" -p {args.project}" if args.project else ""
    logger.info("created %s; see what it renders to: forge render %s%s", path, name, where)
    return EXIT_OK


def cmd_code(args: argparse.Namespace) -> int:
    from forge.config.codegen import generate_script

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
    script = generate_script(
        cfg.targets,
        target=args.target,
        project_root=project.root,
        config_name=name,
        command=shlex.join(words),
        script_name=Path(args.output).name if args.output else "train.py",
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


def cmd_env(args: argparse.Namespace) -> int:
    from forge.envinfo import environment_report

    for key, value in environment_report():
        print(f"{key + ':':24s} {value}")
    return EXIT_OK


COMMANDS = {
    "ls": cmd_ls,
    "render": cmd_render,
    "build": cmd_build,
    "train": cmd_train,
    "resume": cmd_resume,
    "runs": cmd_runs,
    "checkpoints": cmd_checkpoints,
    "generate": cmd_generate,
    "evaluate": cmd_evaluate,
    "predict": cmd_predict,
    "new": cmd_new,
    "new-config": cmd_new_config,
    "code": cmd_code,
    "env": cmd_env,
    "_worker": cmd_worker,
}
