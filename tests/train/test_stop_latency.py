"""A stop signal is acted on within two optimizer steps, on every trainer and with several
processes, however far the next logging step is: the ranks agree on it in each step's own
all-reduce (forge.train.loop_state.StopVote), not only at steps that log or save."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forge.checkpoint import validate_checkpoint
from tests.train.common import checkpoint_dir, run_torchrun


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "accelerate", "pipeline"])
def test_a_signal_stops_two_processes_within_two_steps(kind, tmp_path):
    script = Path(__file__).with_name("stop_latency_script.py")
    output = run_torchrun(script, kind, str(tmp_path))
    stopped = {int(step) for step in re.findall(r"rank \d stopped at step (\d+)", output)}
    assert len(re.findall(r"stopped at step", output)) == 2, output
    assert len(stopped) == 1, output  # every rank at the same step
    (step,) = stopped
    assert step in (6, 7), output  # signalled after step 5; logging_steps is 25
    assert validate_checkpoint(checkpoint_dir(tmp_path, step)) == []
