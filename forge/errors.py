"""Exception kinds the CLI turns into messages and exit codes (no tracebacks unless -v)."""

from __future__ import annotations

EXIT_FAILURE, EXIT_USAGE = 1, 2

# Matched by class name so that classifying an error never imports torch.
_USAGE = {"UsageError", "ConfigError", "TrainingArgumentsError"}
_RUNTIME = {"RuntimeFailure", "RunError", "CheckpointError"}


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit 2."""


class RuntimeFailure(Exception):
    """A runtime failure the user can act on: printed without a traceback, exit 1."""


def exit_code_for(err: BaseException) -> int:
    """2 for usage/config errors, 1 for everything else."""
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & _USAGE:
        return EXIT_USAGE
    return EXIT_FAILURE


def is_expected(err: BaseException) -> bool:
    """True for errors whose message is the whole story (no traceback needed)."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & (_USAGE | _RUNTIME))
