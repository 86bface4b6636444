"""Exception kinds the CLI turns into messages and exit codes (no tracebacks unless -v).

Only the CLI turns errors into exit codes. Errors are matched by class name
(forge.error_kinds) so that classifying an error never imports torch.
"""

from __future__ import annotations

from forge.error_kinds import RUNTIME_ERRORS, USAGE_ERRORS, is_usage_error

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit 2."""


class RuntimeFailure(Exception):
    """A runtime failure the user can act on: printed without a traceback, exit 1."""


def exit_code_for(err: BaseException) -> int:
    """2 for usage/config errors, 1 for everything else."""
    if is_usage_error(err):
        return EXIT_USAGE
    return EXIT_FAILURE


def is_expected(err: BaseException) -> bool:
    """True for errors whose message is the whole story (no traceback needed)."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & (USAGE_ERRORS | RUNTIME_ERRORS))
