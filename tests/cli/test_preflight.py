"""The model/data contract is checked before `forge train` creates a run directory."""

from __future__ import annotations

import pytest

from tests.helpers import run_forge


@pytest.fixture
def classifier(tmp_path):
    assert run_forge("new", "cls", "--from", "classifier", "-p", str(tmp_path)).returncode == 0
    return tmp_path / "cls"


def edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def train_fails_before_any_run(project, *extra: str, dry_run_only: bool = False):
    for dry_run in [["--dry-run"]] if dry_run_only else [[], ["--dry-run"]]:
        result = run_forge("train", "-p", str(project), "-D", "max_steps=2", *dry_run, *extra)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
        assert not (project / "output" / "train").exists()
    return result.stderr


def test_batch_keys_forward_does_not_take(classifier):
    edit(classifier / "data.py", '{"features": self.features', '{"inputs": self.features')
    stderr = train_fails_before_any_run(classifier)
    assert "the batches do not fit MLPClassifier.forward" in stderr
    assert "forward takes no 'inputs'" in stderr
    assert "it needs 'features', which the batch lacks" in stderr
    assert "batch keys: inputs, labels" in stderr
    assert "forward(features, labels=None)" in stderr
    assert "templates/configs/train.yaml:" in stderr  # located at the model's line


def test_forward_returning_a_bare_tensor(classifier):
    edit(classifier / "model.py", 'return {"loss": loss, "logits": logits}', "return logits")
    stderr = train_fails_before_any_run(classifier)
    expected = (
        "MLPClassifier.forward must return an object with .loss or a dict with 'loss' (got Tensor)"
    )
    assert expected in stderr
    assert "CausalLMCollator" not in stderr


def test_forward_returning_no_loss_suggests_labels(classifier):
    edit(classifier / "data.py", '"labels": self.labels[index]', '"targets": self.labels[index]')
    edit(classifier / "model.py", "labels: torch.Tensor | None = None", "**extra")
    edit(classifier / "model.py", "if labels is not None", "if False")
    edit(classifier / "model.py", "F.cross_entropy(logits, labels)", "None")
    stderr = train_fails_before_any_run(classifier, dry_run_only=True)
    assert "returned no loss (dict without 'loss')" in stderr
    assert "batch with keys features, targets" in stderr


def test_blank_config_names_the_missing_model_and_data(tmp_path):
    assert run_forge("new", "b", "--from", "blank", "-p", str(tmp_path)).returncode == 0
    stderr = train_fails_before_any_run(tmp_path / "b", dry_run_only=True)
    assert "trainer.model: null: there is no model to train" in stderr
    assert "trainer.train_dataset: null: there is no data to train on" in stderr


def test_a_fitting_project_passes_the_dry_run(classifier):
    result = run_forge("train", "-p", str(classifier), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "run_NNN" in result.stdout
    assert not (classifier / "output" / "train").exists()


def test_model_partial_missing_an_argument_the_trainer_does_not_pass(classifier):
    config = classifier / "templates" / "configs" / "train.yaml"
    edit(config, "    num_features: {{ num_features }}\n    num_classes", "    num_classes")
    stderr = train_fails_before_any_run(classifier, dry_run_only=True)
    assert "model: the trainer calls this partial as model(), and MLPClassifier() then fails: " in (
        stderr
    )
    assert "missing a required argument: 'num_features'" in stderr
