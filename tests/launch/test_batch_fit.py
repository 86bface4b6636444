"""The plan's largest per-device batch: a memory size, activations measured on one real
micro-batch, and the line ``forge train --dry-run --memory`` prints."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from forge.launch.batch_fit import (
    Activations,
    BatchFit,
    largest_batch,
    measure_activations,
    parse_memory,
)
from tests.helpers import TINY_LM, run_forge


def test_memory_sizes():
    assert parse_memory("16GiB") == 16 * 1024**3
    assert parse_memory("16G") == 16 * 1024**3
    assert parse_memory("80GB") == 80 * 1000**3
    assert parse_memory("1.5 MiB") == 1536 * 1024
    for bad in ("", "GiB", "16 parsecs", "0GiB", "-1G"):
        with pytest.raises(ValueError, match="--memory must be a positive size"):
            parse_memory(bad)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 10), nn.Linear(10, 3)

    def forward(self, x, labels):
        hidden = torch.relu(self.a(x))  # saves relu's output; b saves its input (the same)
        return {"loss": nn.functional.cross_entropy(self.b(hidden), labels)}


def test_activations_are_the_saved_tensors_without_the_weights():
    model = Net()
    rows = 8
    batch = {"x": torch.randn(rows, 6), "labels": torch.zeros(rows, dtype=torch.long)}
    saved = measure_activations(model, batch)
    # a's input (x: 6 floats a row), relu's output (10), cross-entropy's log-softmax (3) and
    # targets (int64), nll_loss's total weight (one float): each storage once, the weights not
    # at all
    assert saved == rows * (6 + 10 + 3) * 4 + rows * 8 + 4
    assert all(p.grad is not None for p in model.parameters())  # the backward ran
    twice = measure_activations(model, {k: torch.cat([v, v]) for k, v in batch.items()})
    assert twice - 4 == 2 * (saved - 4)  # they grow with the rows


def test_largest_batch():
    assert largest_batch(1000, 200, Activations(saved=400, rows=4)) == 8
    assert largest_batch(1000, 950, Activations(saved=400, rows=4)) == 0
    assert largest_batch(100, 200, Activations(saved=400, rows=4)) == 0


def test_the_line_names_the_memory_and_the_figures():
    fit = BatchFit(1024**3, "--memory", Activations(saved=8 * 1024**2, rows=8))
    line = fit.line(state=24 * 1024**2)
    assert line.startswith("  batch fit     in 1.0 GiB (--memory): up to 1000 per device ")
    assert "model state 24.0 MiB + activations 1.0 MiB per row" in line
    assert "not one row fits" in fit.line(state=2 * 1024**3)
    assert "--memory SIZE" in BatchFit(None, "", "").line(0)
    failed = BatchFit(1024, "--memory", "the forward failed").line(0)
    assert failed.endswith("not measured (the forward failed)")


def test_dry_run_prints_the_largest_batch_that_fits(tmp_path):
    project = tmp_path / "tiny_lm"
    shutil.copytree(TINY_LM, project, ignore=shutil.ignore_patterns("output"))
    small = ["-D", "max_files=4", "-D", "vocab_size=512", "-D", "block_size=32"]
    result = run_forge("train", "-p", str(project), "--dry-run", "--memory", "1GiB", *small)
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("  batch fit")]
    assert "in 1.0 GiB (--memory): up to " in line
    assert not (project / "output" / "train").exists()

    bad = run_forge("train", "-p", str(project), "--dry-run", "--memory", "lots", *small)
    assert bad.returncode == 2
    assert "--memory must be a positive size" in bad.stderr
    alone = run_forge("train", "-p", str(project), "--memory", "1GiB", *small)
    assert alone.returncode == 2
    assert "goes with --dry-run" in alone.stderr
