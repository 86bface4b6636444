"""Fixtures for end-to-end runs of the default project through the real `forge` entry point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import TINY_LM, run_forge

# A small, fast variant of tiny_lm: the same templates, shrunk with -D variables.
# max_files=4 keeps the corpus to a few hundred blocks so 40 steps cross an epoch boundary.
SMALL = [
    "-D",
    "vocab_size=512",
    "-D",
    "block_size=32",
    "-D",
    "hidden_size=32",
    "-D",
    "num_layers=2",
    "-D",
    "num_heads=2",
    "-D",
    "max_files=4",
    "-D",
    "batch_size=4",
    "-D",
    "grad_accum=2",
    "-D",
    "max_steps=40",
    "-D",
    "save_steps=10",
    "-D",
    "eval_steps=20",
    "-D",
    "logging_steps=5",
    "-D",
    "warmup_steps=5",
]


@pytest.fixture(scope="session")
def warm_project(tmp_path_factory):
    """tiny_lm with its tokenizer and token caches already built for the SMALL settings."""
    dest = tmp_path_factory.mktemp("warm") / "tiny_lm"
    shutil.copytree(TINY_LM, dest, ignore=shutil.ignore_patterns("output"))
    result = run_forge("build", "-p", str(dest), *SMALL, "--target", "eval_dataset")
    assert result.returncode == 0, result.stderr
    result = run_forge("build", "-p", str(dest), *SMALL, "--target", "train_dataset")
    assert result.returncode == 0, result.stderr
    shutil.rmtree(dest / "output" / "build", ignore_errors=True)
    return dest


@pytest.fixture
def project(warm_project, tmp_path):
    """A private copy of the warm tiny_lm, so each test's runs stay in its tmp_path."""
    dest = tmp_path / "tiny_lm"
    shutil.copytree(warm_project, dest)
    return dest


@pytest.fixture(scope="session")
def trained_once(warm_project, tmp_path_factory):
    """One completed 40-step run of the small tiny_lm, shared read-only."""
    dest = tmp_path_factory.mktemp("trained") / "tiny_lm"
    shutil.copytree(warm_project, dest)
    result = run_forge("train", "-p", str(dest), *SMALL)
    assert result.returncode == 0, result.stderr
    return dest, Path(result.stdout.splitlines()[0]), result


@pytest.fixture
def trained(trained_once, tmp_path):
    """A private copy of the trained project, for tests that change or add runs."""
    source, run_dir, result = trained_once
    dest = tmp_path / "tiny_lm"
    shutil.copytree(source, dest)
    return dest, dest / run_dir.relative_to(source), result
