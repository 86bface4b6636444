"""The ``forge`` command line: thin wrappers over forge.config, forge.runs and the trainers.

Stdout carries data (rendered YAML, tables, the run directory); stderr carries logs and
progress. Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 128+N on signal N
(130 Ctrl-C, 143 SIGTERM). Heavy modules (torch, transformers) are imported only by the
commands that need them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from forge import __version__
from forge.config import ConfigError, Project, find_project, load_config, load_project
from forge.config import parse_define as _parse_define
from forge.errors import RuntimeFailure, UsageError, exit_code_for, is_expected

logger = logging.getLogger("forge")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


# --------------------------------------------------------------------------- helpers


def _setup_logging(verbose: bool) -> None:
    from forge.train.topology import Topology

    topology = Topology.from_env()
    rank = topology.rank
    prefix = f"[rank {rank}] " if topology.distributed and rank else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(prefix))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = logging.DEBUG if verbose else logging.INFO
    root.setLevel(level if rank == 0 else logging.WARNING)
    for noisy in ("urllib3", "filelock", "torch.distributed.elastic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _Formatter(logging.Formatter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and logging.getLogger().isEnabledFor(logging.DEBUG):
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"{self.prefix}{record.levelname.lower()}: {message}"
        return f"{self.prefix}{message}"


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


def _table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _nproc(value: str | None, default: int = 1) -> int:
    if value is None:
        return default
    if value == "auto":
        import torch

        return max(torch.cuda.device_count(), 1)
    try:
        n = int(value)
    except ValueError as err:
        raise UsageError(f"--nproc must be a positive integer or 'auto' (got {value!r})") from err
    if n < 1:
        raise UsageError(f"--nproc must be a positive integer or 'auto' (got {value!r})")
    return n


# --------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    project = _project(args)
    rows, broken = [], []
    for name in project.list_configs():
        try:
            cfg = load_config(project, name, variables=_defines(args), allow=args.allow or [])
            problems = cfg.check()
        except ConfigError as err:
            problems = err.problems
        status = "ok" if not problems else f"{len(problems)} problem(s)"
        if problems:
            broken.append((name, problems))
        default = "*" if name == project.default_config else ""
        rows.append([name + default, status])
    print(f"project {project.name}: {project.description}".rstrip(": "))
    print(_table(rows, ["CONFIG", "CHECK"]) if rows else "(no configs in templates/configs/)")
    for name, problems in broken:
        print(f"\n{name}:\n" + str(ConfigError(problems)), file=sys.stderr)
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
    from forge.runs import config_output_dir, create_run

    project = _project(args)
    name, cfg = _load(args, project)
    nproc = _nproc(args.nproc)
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
        code = _launch(project, run_dir, nproc, args, resume_from=None)
    except Exception as err:
        if exit_code_for(err) == EXIT_USAGE:
            _discard_unstarted_run(run_dir)
        raise
    if code == EXIT_USAGE:
        _discard_unstarted_run(run_dir)
    return code


def _discard_unstarted_run(run_dir: Path) -> None:
    """Remove a run that a config error stopped before it wrote anything but its record."""
    if {p.name for p in run_dir.iterdir()} <= {"config.yaml", "run.json"}:
        for path in run_dir.iterdir():
            path.unlink()
        run_dir.rmdir()
        logger.info("removed %s: the run never started", run_dir)


def cmd_resume(args: argparse.Namespace) -> int:
    from forge.config import parse_config
    from forge.runs import RunRecord, find_run, now_iso

    project = _project(args)
    config = project.resolve_config_name(args.config) if args.config else None
    run_dir = find_run(
        project.output_dir,
        number=args.run,
        run_dir=Path(args.run_dir) if args.run_dir else None,
        config_name=config,
    )
    from forge.checkpoint import find_latest_checkpoint, validate_checkpoint

    if args.from_checkpoint:
        checkpoint = Path(args.from_checkpoint).resolve()
        problems = validate_checkpoint(checkpoint)
        if problems:
            raise RuntimeFailure(f"cannot resume from {checkpoint}:\n  " + "\n  ".join(problems))
    else:
        checkpoint = find_latest_checkpoint(run_dir / "checkpoints")
        if checkpoint is None:
            raise RuntimeFailure(
                f"{run_dir} has no valid checkpoint to resume from; nothing was changed. "
                "Start a new run with `forge train`, or pass --from CKPT."
            )
    record = RunRecord.load(run_dir)
    config_path = run_dir / "config.yaml"
    overrides = args.set or []
    if overrides:
        cfg = parse_config(
            config_path.read_text(),
            project=project,
            overrides=overrides,
            allow=args.allow or [],
            origin=str(config_path),
        )
        problems = cfg.check()
        if problems:
            raise ConfigError(problems, config=str(config_path))
        config_path.write_text(cfg.text)
    nproc = _nproc(args.nproc, default=int(record.data.get("world_size") or 1))
    resumes = record.data.get("resumes", [])
    resumes.append(
        {"at": now_iso(), "from": str(checkpoint), "overrides": overrides, "world_size": nproc}
    )
    record.update(resumes=resumes)
    print(run_dir, flush=True)
    logger.info("resuming %s from %s", run_dir, checkpoint)
    return _launch(project, run_dir, nproc, args, resume_from=str(checkpoint))


def _launch(
    project: Project, run_dir: Path, nproc: int, args: argparse.Namespace, resume_from
) -> int:
    """Run the worker here (one process) or under torchrun, forwarding Ctrl-C/SIGTERM."""
    allow = args.allow or []
    if nproc == 1 and not args.torchrun_args:
        from forge.worker import run_worker

        return run_worker(run_dir, project, resume_from=resume_from, allow=allow)
    command = [sys.executable, "-m", "forge.launch", f"--nproc_per_node={nproc}"]
    if not any(a.startswith(("--rdzv", "--nnodes", "--master")) for a in args.torchrun_args):
        command.append("--standalone")
    command += list(args.torchrun_args)
    command += ["-m", "forge.cli", "_worker", "--run-dir", str(run_dir), "-p", str(project.root)]
    if resume_from:
        command += ["--resume-from", str(resume_from)]
    for module in allow:
        command += ["--allow", module]
    if args.verbose:
        command.append("-v")
    logger.info("launching %d processes: %s", nproc, " ".join(command))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // nproc, 1)))
    child = subprocess.Popen(command, start_new_session=True, env=env)

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _exit_code_from_record(run_dir, code)


def _exit_code_from_record(run_dir: Path, code: int) -> int:
    from forge.runs import RunRecord

    data = RunRecord.load(run_dir).data
    if data.get("status") == "interrupted" and data.get("signal"):
        return 128 + int(signal.Signals[data["signal"]])
    if data.get("status") == "completed":
        return EXIT_OK
    if data.get("status") == "failed" and data.get("error_kind") == "usage":
        return EXIT_USAGE  # rank 0 has printed the message
    return code if code > 0 else EXIT_FAILURE


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
    from forge.checkpoint import find_checkpoints
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


def _human_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}TB"


def cmd_generate(args: argparse.Namespace) -> int:
    from forge.generate import generate_text, resolve_checkpoint

    checkpoint = resolve_checkpoint(Path(args.checkpoint))
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


def cmd_env(args: argparse.Namespace) -> int:
    from forge.envinfo import environment_report

    for key, value in environment_report():
        print(f"{key + ':':24s} {value}")
    return EXIT_OK


# --------------------------------------------------------------------------- parser

EXAMPLES = {
    "ls": """
        examples:
          forge ls                          # the project that contains the working directory
          forge ls -p projects/tiny_lm      # an explicit project
    """,
    "render": """
        examples:
          forge render -p projects/tiny_lm                    # the default config, as YAML
          forge render train -p projects/tiny_lm -D max_steps=50
          forge render train -p projects/tiny_lm --set trainer.args.save_steps=25
          forge render train -p projects/tiny_lm --chain      # which templates, in order
          forge render train -p projects/tiny_lm --graph      # nodes with callables resolved
    """,
    "build": """
        examples:
          forge build train -p projects/tiny_lm --target meta
          forge build train -p projects/tiny_lm --target optimizer
    """,
    "train": """
        examples:
          forge train -p projects/tiny_lm                         # default config, 1 process
          forge train train -p projects/tiny_lm -D max_steps=100 -D save_steps=25
          forge train train -p projects/tiny_lm --set trainer.args.learning_rate=1e-3
          forge train train -p projects/tiny_lm --nproc 2        # DDP under torchrun (gloo on CPU)
          forge train train -p projects/tiny_lm --dry-run        # render and check only
          forge train train --nproc 8 -- --nnodes 2 --rdzv-endpoint host:29400   # multi-node
    """,
    "resume": """
        examples:
          forge resume -p projects/tiny_lm                          # newest run, newest checkpoint
          forge resume -p projects/tiny_lm --run 3
          forge resume --run-dir projects/tiny_lm/output/train/run_003
          forge resume -p projects/tiny_lm --set trainer.args.max_steps=800   # train longer
          forge resume -p projects/tiny_lm --from path/to/checkpoint-000400
    """,
    "runs": """
        examples:
          forge runs -p projects/tiny_lm
    """,
    "checkpoints": """
        examples:
          forge checkpoints -p projects/tiny_lm             # sizes checked
          forge checkpoints -p projects/tiny_lm --verify    # hashes too
          forge checkpoints -p projects/tiny_lm --run 2
    """,
    "generate": """
        examples:
          forge generate projects/tiny_lm/output/train/run_001 --prompt "def "
          forge generate path/to/checkpoint-000400 --prompt "import " --num 3
    """,
    "env": """
        examples:
          forge env            # paste this into a bug report
    """,
}


def _sub(subparsers, name: str, help_text: str, func) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=help_text,
        epilog=textwrap.dedent(EXAMPLES.get(name, "")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=func)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show tracebacks and debug logs"
    )
    return parser


def _add_project(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-p",
        "--project",
        metavar="DIR",
        help="project directory (default: nearest ancestor of the cwd with a meta.yaml)",
    )


def _add_config_inputs(parser: argparse.ArgumentParser, *, config: bool = True) -> None:
    if config:
        parser.add_argument(
            "config",
            nargs="?",
            metavar="CONFIG",
            help="config name (default: meta.yaml's default_config)",
        )
    _add_project(parser)
    parser.add_argument(
        "-D",
        "--define",
        action="append",
        metavar="VAR=VALUE",
        help="template variable (value parsed as YAML)",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY.PATH=VALUE",
        help="override a key of the rendered YAML",
    )
    parser.add_argument(
        "--allow", action="append", metavar="MODULE", help="allow callables from this module root"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forge",
        description="Turn inheritable Jinja/YAML templates into resumable PyTorch training jobs.",
        epilog=textwrap.dedent(
            """
            quick start:
              forge ls -p projects/tiny_lm
              forge render -p projects/tiny_lm
              forge train -p projects/tiny_lm -D max_steps=100
              forge resume -p projects/tiny_lm
              forge generate projects/tiny_lm/output/train/run_001 --prompt "def "

            `forge COMMAND --help` shows worked examples for each command.
            Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 130 Ctrl-C, 143 SIGTERM.
            """
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"forge {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _sub(subparsers, "ls", "list a project's configs, each rendered and checked", cmd_ls)
    _add_project(p)
    p.add_argument("-D", "--define", action="append", metavar="VAR=VALUE", help="template variable")
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")

    p = _sub(
        subparsers,
        "render",
        "print a config's rendered YAML (or its graph or template chain)",
        cmd_render,
    )
    _add_config_inputs(p)
    view = p.add_mutually_exclusive_group()
    view.add_argument(
        "--graph", action="store_true", help="show the node tree with callables resolved"
    )
    view.add_argument("--chain", action="store_true", help="show the template files used, in order")

    p = _sub(subparsers, "build", "build one target of a config and print its repr", cmd_build)
    _add_config_inputs(p)
    p.add_argument("--target", required=True, metavar="NAME", help="top-level key to build")
    p.add_argument("--run-dir", metavar="DIR", help="value of !var run_dir (default: output/build)")

    p = _sub(subparsers, "train", "train a config in a new run directory", cmd_train)
    _add_config_inputs(p)
    p.add_argument("--nproc", metavar="N|auto", help="processes (>1 runs under torchrun)")
    p.add_argument("--dry-run", action="store_true", help="render and check, do not train")

    p = _sub(subparsers, "resume", "continue a run from its newest valid checkpoint", cmd_resume)
    _add_project(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--run", type=int, metavar="N", help="run number (default: newest run)")
    which.add_argument("--run-dir", metavar="DIR", help="run directory")
    p.add_argument("--config", metavar="NAME", help="config whose runs --run numbers")
    p.add_argument(
        "--from", dest="from_checkpoint", metavar="CKPT", help="checkpoint to resume from"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY.PATH=VALUE",
        help="override a key of the run's config",
    )
    p.add_argument("--allow", action="append", metavar="MODULE", help="allow this module root")
    p.add_argument("--nproc", metavar="N|auto", help="processes (default: as the run was started)")

    p = _sub(subparsers, "runs", "table of a project's runs", cmd_runs)
    _add_project(p)

    p = _sub(
        subparsers, "checkpoints", "table of checkpoints and whether each is valid", cmd_checkpoints
    )
    _add_project(p)
    p.add_argument("--run", type=int, metavar="N", help="only this run number")
    p.add_argument("--run-dir", metavar="DIR", help="only this run directory")
    p.add_argument(
        "--verify", action="store_true", help="check every file's hash, not only its size"
    )

    p = _sub(
        subparsers,
        "generate",
        "sample text from a checkpoint (or a run's newest one)",
        cmd_generate,
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or run directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--num", type=int, default=1, help="number of samples")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)

    p = _sub(subparsers, "env", "versions, devices and backends (for bug reports)", cmd_env)

    p = subparsers.add_parser("_worker")  # internal: one rank of a launched job
    p.set_defaults(func=cmd_worker)
    p.add_argument("--run-dir", required=True)
    p.add_argument("-p", "--project", required=True)
    p.add_argument("--resume-from")
    p.add_argument("--allow", action="append")
    p.add_argument("-v", "--verbose", action="store_true")
    return parser


def _split_torchrun_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, torchrun_args = _split_torchrun_args(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in ("train", "resume"):
        args.torchrun_args = torchrun_args
    elif torchrun_args:
        parser.error("arguments after -- are only for `forge train` and `forge resume`")
    verbose = getattr(args, "verbose", False)
    _setup_logging(verbose)
    return _run(args, verbose)


def _run(args: argparse.Namespace, verbose: bool) -> int:
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if verbose:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # every failure becomes a message and an exit code
        if verbose:
            raise
        from forge.train.topology import Topology

        rank = Topology.from_env().rank
        if is_expected(err):
            if rank == 0:  # every rank sees the same config error; one message is enough
                print(f"error: {err}", file=sys.stderr)
        else:
            prefix = f"[rank {rank}] " if rank else ""
            print(f"{prefix}error: {type(err).__name__}: {err}", file=sys.stderr)
            print("(run again with -v for the traceback)", file=sys.stderr)
        return exit_code_for(err)


if __name__ == "__main__":
    sys.exit(main())
