"""The launch layer's own error: forge was started in a way it cannot launch a job from."""

from __future__ import annotations


class LaunchUsageError(Exception):
    """A bad ``--nproc``, ``--max-restarts`` or ``--nnodes``, an allocation forge cannot run in
    (SLURM), or a job's run that a rank cannot see: printed without a traceback, exit 2 (the
    CLI maps it by class name, forge.error_kinds)."""
