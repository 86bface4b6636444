"""The read side's refusals, matched by class name (forge.error_kinds) like every layer's.

``ReadUsageError``: what was asked of a checkpoint cannot be done with it (an option it does
not support, an output that exists): the caller's to fix, exit 2 at the CLI.
``ReadFailure``: the checkpoint or its model cannot give what was asked (weights that are not
the described architecture's, a model that does not generate): exit 1.
"""

from __future__ import annotations


class ReadUsageError(ValueError):
    """A request the checkpoint cannot serve as asked; the message says what to change."""


class ReadFailure(RuntimeError):
    """The checkpoint (or the model built from it) cannot give what was asked."""
