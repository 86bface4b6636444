"""The sanity pass: before a run directory exists, what training runs is run once (one training
batch forward and backward, two evaluation batches through compute_metrics), so a mistake that
used to surface after training steps fails in seconds, exit 2, at the config line of the part
that failed; and a run with the pass trains bit for bit as the run without it."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import run_forge

pytestmark = pytest.mark.integration

SMALL = ["-D", "max_steps=6", "-D", "eval_steps=3", "-D", "save_steps=3", "-D", "num_samples=256"]

METRICS_PY = '''
def broken(prediction):
    return {"accuracy": 1 / 0}


class OneItem:
    """A collator that takes one item at a time (a batch size of 1 is configured)."""

    def __call__(self, items):
        assert len(items) == 1, len(items)
        import torch
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}


class TrainOnly:
    """A collator that handles training items only: the evaluation split holds others."""

    def __call__(self, items):
        import torch
        if len(items) == 8:  # the evaluation batches are 8 items (training's 64)
            raise TypeError("iteration over a 0-d tensor")
        return {k: torch.stack([item[k] for item in items]) for k in items[0]}
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sanity")
    assert run_forge("new", "demo", "--from", "classifier", "-p", str(root)).returncode == 0
    project = root / "demo"
    (project / "parts.py").write_text(METRICS_PY)
    configs = project / "templates" / "configs"
    (configs / "metrics.yaml").write_text(
        "-- extends 'configs/train.yaml'\n-- block trainer\n    == super()\n"
        "    compute_metrics: !partial:./parts.py:broken []\n-- endblock\n"
    )
    (configs / "latemetrics.yaml").write_text(
        "-- extends 'configs/train.yaml'\n-- block trainer\n    == super()\n"
        "    compute_metrics: !partial:./parts.py:broken []\n-- endblock\n"
        "-- block trainer_args\n    == super()\n    num_sanity_val_steps: 0\n-- endblock\n"
    )
    (configs / "evalcollate.yaml").write_text(
        "-- extends 'configs/train.yaml'\n-- block collator\n"
        "data_collator: &data_collator !singleton:./parts.py:TrainOnly []\n-- endblock\n"
        "-- block trainer_args\n    == super()\n    per_device_eval_batch_size: 8\n-- endblock\n"
    )
    (configs / "oneitem.yaml").write_text(
        "-- extends 'configs/train.yaml'\n-- block collator\n"
        "data_collator: &data_collator !singleton:./parts.py:OneItem []\n-- endblock\n"
        "-- block trainer_args\n    == super()\n    per_device_train_batch_size: 1\n"
        "    per_device_eval_batch_size: 1\n-- endblock\n"
    )
    (configs / "checkpointing.yaml").write_text(
        "-- extends 'configs/train.yaml'\n-- block trainer_args\n    == super()\n"
        "    gradient_checkpointing: true\n    activation_checkpointing_modules: [Blok]\n"
        "-- endblock\n"
    )
    return project


def no_runs(project: Path, config: str) -> bool:
    return not (project / "output" / config).exists()


def test_a_metric_that_fails_is_found_before_the_run_exists(project):
    result = run_forge("train", "metrics", "-p", str(project), *SMALL)
    assert result.returncode == 2, result.stderr
    assert "sanity pass" in result.stderr and "computing the metrics" in result.stderr
    assert "ZeroDivisionError" in result.stderr and "metrics.yaml:4" in result.stderr
    assert "num_sanity_val_steps: 0 skips the evaluation batches" in result.stderr
    assert result.stdout == "" and no_runs(project, "metrics")
    dry = run_forge("train", "metrics", "-p", str(project), "--dry-run", *SMALL)
    assert dry.returncode == 2 and "computing the metrics" in dry.stderr


@pytest.mark.slow
def test_a_metric_that_fails_at_the_first_evaluation_in_training_is_located(project):
    """Past the sanity pass (its evaluation batches skipped), the failure at step 3's evaluation
    is named as the pass names it: the template line that sets trainer.compute_metrics."""
    result = run_forge("train", "latemetrics", "-p", str(project), *SMALL)
    assert result.returncode == 1, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("error:"))
    assert line.startswith("error: ") and "templates/configs/latemetrics.yaml:4: " in line, line
    assert (
        "trainer.compute_metrics failed while computing the metrics of the evaluation at step 3: "
        "ZeroDivisionError: division by zero (raised at "
    ) in line
    assert "parts.py:3, in broken)" in line and "Traceback" not in result.stderr


def test_an_evaluation_collator_that_fails_is_found_before_the_run_exists(project):
    result = run_forge("train", "evalcollate", "-p", str(project), *SMALL)
    assert result.returncode == 2, result.stderr
    assert "collating evaluation items" in result.stderr
    assert "iteration over a 0-d tensor" in result.stderr
    assert "evalcollate.yaml:3" in result.stderr and no_runs(project, "evalcollate")


def test_a_misspelled_checkpointing_block_is_found_by_the_dry_run(project):
    result = run_forge("train", "checkpointing", "-p", str(project), "--dry-run", *SMALL)
    assert result.returncode == 2, result.stderr
    assert "'Blok'" in result.stderr and "checkpointing.yaml" in result.stderr
    assert "sanity_check" not in result.stderr  # training's first step meets it too: no skip


def test_a_collator_for_batches_of_one_is_given_one_item(project):
    result = run_forge("train", "oneitem", "-p", str(project), "--dry-run", *SMALL)
    assert result.returncode == 0, result.stderr


def test_a_run_with_the_sanity_pass_is_bitwise_the_run_without_it(project):
    """Training in the process that ran the pass: its generators are put back."""
    runs = []
    for sanity in ("true", "false"):
        result = run_forge(
            "train", "-p", str(project), *SMALL, "-D", "report_to=none",
            "--set", f"trainer.args.sanity_check={sanity}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert ("sanity pass:" in result.stderr) == (sanity == "true")
        runs.append(Path(result.stdout.strip()) / "checkpoints" / "checkpoint-000006")
    with_pass, without = (load_file(run / "model.safetensors") for run in runs)
    assert with_pass.keys() == without.keys()
    assert all((with_pass[k] == without[k]).all() for k in with_pass)


PIPELINE_EXTRA = """\
-- extends 'configs/pipeline.yaml'
-- block collator
data_collator: &data_collator !singleton:./extra.py:WithPixels []
-- endblock
"""

EXTRA_PY = '''
import torch


class WithPixels:
    """Batches of a vision-language model: token ids and images."""

    def __call__(self, items):
        ids = torch.stack([item["input_ids"] for item in items])
        return {"input_ids": ids, "labels": ids, "pixel_values": torch.zeros(len(items), 3, 4, 4)}
'''


def test_batches_the_pipeline_cannot_take_are_refused_before_the_run_exists(tmp_path):
    """The pipeline's first stage takes input ids only: a batch with images failed on every
    rank after torchrun started (the dry run printed a full plan). Now the sanity pass runs the
    batch through the pipeline trainer's own path first."""
    from tests.plain_project import write_project

    project = write_project(tmp_path / "plain")
    (project / "extra.py").write_text(EXTRA_PY)
    (project / "templates" / "configs" / "pixels.yaml").write_text(PIPELINE_EXTRA)
    result = run_forge("train", "pixels", "-p", str(project), "--nproc", "2", "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "cannot pass on ['pixel_values']" in result.stderr
    assert "the first training batch's forward and backward" in result.stderr
    assert no_runs(project, "pixels")
