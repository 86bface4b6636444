"""The ``forge`` command line: parse, dispatch, and turn every failure into an exit code.

Stdout carries data (rendered YAML, tables, the run directory); stderr carries logs and
progress. Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 128+N on signal N
(130 Ctrl-C, 143 SIGTERM). The argument parser lives in :mod:`forge.cli.parser`, the thin
command functions in :mod:`forge.cli.commands`. A command that is a body of its own lives
beside them (``export``, ``predict`` for evaluate and predict, ``generate``, ``plot``, ``new``
for new and new-config, ``env``); the others drive the part they belong to (forge.config,
forge.runs, forge.launch, ...: what ``forge train`` says of a config's length is
forge.launch.length_note's, shared with the Python API). Heavy modules (torch, transformers) are imported only by the commands that need them.
"""

from __future__ import annotations

import argparse
import logging
import sys

if sys.argv[1:2] == ["_worker"]:  # a rank torchrun started: a stop while forge loads is noted
    from forge.train.signals import note_stops_while_loading

    note_stops_while_loading()

from forge.cli.commands import COMMANDS
from forge.cli.exits import EXIT_USAGE, exit_code_for, is_expected
from forge.cli.parser import build_parser, split_torchrun_args
from forge.extras import missing_package_hint

__all__ = ["main"]


def setup_logging(verbose: bool) -> None:
    """Log to stderr; rank 0 at INFO (DEBUG with -v), other ranks only warnings, prefixed."""
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
    # libraries' info lines (connections, locks, the agent); a checkpoint's weight-save line is
    # kept out where it is written (forge.checkpoint.io.quiet_hub_saves)
    for noisy in ("urllib3", "filelock", "torch.distributed.elastic", "huggingface_hub"):
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


def main(argv: list[str] | None = None) -> int:
    """Run ``forge ARGV`` (``sys.argv`` when None: the process's own command) to an exit code."""
    if argv is None:
        try:
            return _main(sys.argv[1:])
        finally:
            if "torch" in sys.modules:  # a light command's shutdown is quick as it is
                from forge.lifetime import prepare_a_quick_exit

                prepare_a_quick_exit()  # the process's own command: it ends here
    return _main(list(argv))


def _main(argv: list[str]) -> int:
    argv, torchrun_args = split_torchrun_args(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in ("train", "resume"):
        args.torchrun_args = torchrun_args
    elif torchrun_args:
        parser.error("arguments after -- are only for `forge train` and `forge resume`")
    verbose = getattr(args, "verbose", False)
    wrong = _launcher_environment_error()
    if wrong:
        print(f"error: {wrong}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(verbose)
    refused = _refused_under_a_launcher(args.command)
    if refused is not None:
        if refused:
            print(f"error: {refused}", file=sys.stderr)
        return EXIT_USAGE
    _install_run_lookup()
    return _run(COMMANDS[args.command], args, verbose)


#: the commands that run on every rank of a job another launcher started (accelerate launch, a
#: user's torchrun); ``_worker`` is a rank forge's own torchrun started
ON_EVERY_RANK = ("train", "resume", "evaluate", "_worker")


def _launcher_environment_error() -> str | None:
    """What is wrong with the rank variables a launcher sets (RANK beyond WORLD_SIZE: a
    variable left over in the shell, or a launcher's slip), before anything reads them."""
    from forge.train.topology import Topology

    try:
        Topology.from_env()
    except ValueError as err:
        return (
            f"the environment's process variables do not agree ({err}): forge reads RANK, "
            "WORLD_SIZE and LOCAL_RANK (or MPI's) as a launcher sets them; unset them, or start "
            "forge with the launcher"
        )
    return None


def _refused_under_a_launcher(command: str) -> str | None:
    """Why ``command`` cannot run on every rank of a launched job (each rank would write the
    same files or print the same rows), said by rank 0 only; None where it can, or outside one."""
    from forge.train.topology import Topology

    topology = Topology.from_env()
    if command in ON_EVERY_RANK or not topology.distributed:
        return None
    if not topology.is_main:
        return ""  # the same refusal, said once
    return (
        f"`forge {command}` is a one-process command, and this process is rank {topology.rank}"
        f" of {topology.world_size} started by a launcher (accelerate launch, torchrun): run it "
        "without the launcher (only train, resume and evaluate run on every rank of a job)"
    )


def _install_run_lookup() -> None:
    """A project directory or ``--best`` names a run's checkpoint through forge.runs, wherever a
    checkpoint is resolved (the trainer's ``resume_from_checkpoint`` too)."""
    from forge.checkpoint.resolve import use_run_lookup
    from forge.runs import PROJECT_RUNS

    use_run_lookup(PROJECT_RUNS)


def _run(command, args: argparse.Namespace, verbose: bool) -> int:
    try:
        return command(args)
    except KeyboardInterrupt:
        if verbose:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # every failure becomes a message and an exit code
        from forge.train.signals import TrainingInterrupted

        if verbose:
            raise
        from forge.train.topology import Topology

        rank = Topology.from_env().rank
        if isinstance(err, TrainingInterrupted):  # a stop signal before any training began
            if rank == 0:
                print(f"{err}: stopped before training started", file=sys.stderr)
            return 128 + err.signum
        prefix = f"[rank {rank}] " if rank else ""
        if is_expected(err):
            # every rank sees the same config error: one message is enough; a runtime failure
            # (a checkpoint this rank could not write) is this rank's own
            if rank == 0 or exit_code_for(err) != EXIT_USAGE:
                print(f"{prefix}error: {err}", file=sys.stderr)
        else:
            print(f"{prefix}error: {type(err).__name__}: {err}", file=sys.stderr)
            for note in getattr(err, "__notes__", ()):  # e.g. the config node being built
                print(f"    {note}", file=sys.stderr)
            hint = missing_package_hint(err)
            if hint is not None:
                print(f"    {hint}", file=sys.stderr)
            print("(run again with -v for the traceback)", file=sys.stderr)
        return exit_code_for(err)
