"""``tests.helpers.run_forge`` forks most commands from a server that imported torch,
transformers and forge once: a forked command must be the command a fresh process is."""

from __future__ import annotations

import multiprocessing
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import FRESH_ENV, forks, run_forge
from tests.train.common import assert_same_tensors

FRESH = {FRESH_ENV: "1"}


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    root = tmp_path_factory.mktemp("forked")
    assert run_forge("new", "c", "--from", "classifier", "-p", str(root)).returncode == 0
    return root / "c"


def steps(stderr: str) -> list[str]:
    """The step and evaluation lines, less what differs between any two runs (time, memory)."""
    keep = []
    for line in stderr.splitlines():
        if line.startswith(("step ", "eval at step ")):
            fields = line.split(" | ")
            keep.append(" | ".join(f for f in fields if not f.startswith(NOISY)))
    return keep


NOISY = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "peak_rss_mb")


def test_a_forked_command_trains_bit_for_bit_as_a_fresh_process(classifier):
    """Dropout and evaluation draw from the generators: a server that had drawn or threaded
    differently from a fresh interpreter would show here."""
    if not forks():
        pytest.skip("run_forge does not fork here (FORGE_TEST_FRESH=1, or no fork server)")
    args = ["train", "-p", str(classifier), "-D", "max_steps=6", "-D", "eval_steps=3"]
    args += ["-D", "save_steps=6", "-D", "dropout=0.2", "-D", "logging_steps=1"]
    forked = run_forge(*args)
    fresh = run_forge(*args, env=FRESH)
    assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
    runs = [Path(result.stdout.splitlines()[0]) for result in (forked, fresh)]
    assert runs[0] != runs[1]
    assert steps(forked.stderr) == steps(fresh.stderr) and len(steps(fresh.stderr)) == 8
    weights = [
        load_file(run / "checkpoints" / "checkpoint-000006" / "model.safetensors") for run in runs
    ]
    assert_same_tensors(weights[0], weights[1], "weights")


def test_a_refused_command_says_the_same_and_exits_the_same_forked_or_fresh(classifier):
    args = ["train", "-p", str(classifier), "--set", "trainer.args.max_stesp=3"]
    forked, fresh = run_forge(*args), run_forge(*args, env=FRESH)
    assert forked.returncode == fresh.returncode == 2, fresh.stderr
    assert forked.stderr == fresh.stderr and "max_steps" in fresh.stderr
    assert forked.stdout == fresh.stdout


def test_a_forked_command_past_its_timeout_is_killed(classifier):
    if not forks():
        pytest.skip("run_forge does not fork here (FORGE_TEST_FRESH=1, or no fork server)")
    args = ["train", "-p", str(classifier), "-D", "max_steps=100000000"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_forge(*args, timeout=5)
    assert not multiprocessing.active_children()
