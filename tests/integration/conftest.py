"""Fixtures for end-to-end runs of the default project through the real `forge` entry point."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import TINY_LM

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


@pytest.fixture
def project(tmp_path):
    """A private copy of projects/tiny_lm, so runs and caches stay in tmp_path."""
    dest = tmp_path / "tiny_lm"
    shutil.copytree(TINY_LM, dest, ignore=shutil.ignore_patterns("output"))
    return dest
