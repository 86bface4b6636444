"""Which errors are the user's to fix (a bad command line, config, argument or request) and
which are runtime failures whose message is the whole story, by class name.

Matched by name so that classifying an error never imports torch, and no layer imports
another's errors to name them. The CLI turns the kinds into exit codes (forge.cli.exits); a
training process records its failure's kind in ``run.json`` (forge.launch.worker), from which
the launcher tells the job's exit code.
"""

from __future__ import annotations

USAGE_ERRORS = frozenset(
    {
        "UsageError",  # forge.cli.exits: the command line
        "LaunchUsageError",  # forge.launch.errors: --nproc, --nnodes, SLURM, a job's run
        "ConfigError",  # forge.config
        "TrainingArgumentsError",  # forge.train.args
        "LoraUsageError",  # forge.train.lora: the base model given
        "CheckpointUsageError",  # forge.checkpoint.resolve: options that contradict the path
        "ReadUsageError",  # forge.read: what a checkpoint is asked cannot be done with it
        "AmbiguousRunError",  # forge.runs: a run number several configs have
        "SweepUsageError",  # forge.sweep: axes, objective, direction, sampler or pruner
        "SweepStateError",  # forge.sweep: another config's (or search's) sweep directory
    }
)
# a usage error may subclass one of these (CheckpointUsageError is a CheckpointError): usage wins
RUNTIME_ERRORS = frozenset(
    {
        "RuntimeFailure",
        "ReadFailure",  # forge.read: the checkpoint or its model cannot give what was asked
        "RunError",
        "CheckpointError",
        "UserCodeFailure",  # forge.train.user_code: compute_metrics failed in training
    }
)


def is_usage_error(err: BaseException) -> bool:
    """The user's input is wrong (exit 2 at the CLI; ``error_kind: usage`` in run.json)."""
    return bool({cls.__name__ for cls in type(err).__mro__} & USAGE_ERRORS)
