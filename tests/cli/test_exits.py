"""Only the CLI turns errors into exit codes: each layer's own usage error is mapped by its
class name to exit 2, a runtime failure to 1, and a launched job ends with the same codes."""

from __future__ import annotations

import pytest

from forge.checkpoint.resolve import CheckpointNotFound, CheckpointUsageError
from forge.cli.exits import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    RuntimeFailure,
    UsageError,
    exit_code_for,
    is_expected,
)
from forge.config import ConfigError
from forge.launch import torchrun
from forge.launch.errors import LaunchUsageError
from forge.runs import RunError
from forge.train.args import TrainingArgumentsError
from forge.train.lora import LoraUsageError


@pytest.mark.parametrize(
    "error",
    [
        UsageError("x"),
        LaunchUsageError("x"),
        CheckpointUsageError("x"),
        LoraUsageError("x"),
        TrainingArgumentsError(["x"]),
        ConfigError("x"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_each_layers_usage_error_exits_2_without_a_traceback(error):
    assert exit_code_for(error) == EXIT_USAGE and is_expected(error)


@pytest.mark.parametrize(
    "error",
    [RuntimeFailure("x"), RunError("x"), CheckpointNotFound("x")],
    ids=lambda error: type(error).__name__,
)
def test_a_runtime_failure_exits_1_without_a_traceback(error):
    assert exit_code_for(error) == EXIT_FAILURE and is_expected(error)


def test_anything_else_exits_1_with_its_type_named():
    assert exit_code_for(KeyError("x")) == EXIT_FAILURE and not is_expected(KeyError("x"))


def test_a_launched_job_ends_with_the_clis_codes():
    assert (torchrun.EXIT_OK, torchrun.EXIT_FAILURE, torchrun.EXIT_USAGE) == (
        EXIT_OK,
        EXIT_FAILURE,
        EXIT_USAGE,
    )
