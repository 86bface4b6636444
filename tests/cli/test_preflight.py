"""The model/data contract is checked before `forge train` creates a run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    # logits, not a loss: the trainer's compute_loss_func computes one from them
    assert "is predictions, not a loss: give the trainer a compute_loss_func" in stderr


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


PLAIN_MODEL = '''"""A model as plain PyTorch code writes it: forward(x, y) returns the loss tensor."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x, y=None):
        logits = self.body(x)
        return logits if y is None else nn.functional.cross_entropy(logits, y)
'''

PLAIN_DATA = '''"""A dataset as plain PyTorch code writes it: items are (x, y) tuples."""
import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    def __init__(self, n: int = 128, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.y = torch.randint(3, (n,), generator=generator)
        self.x = torch.randn(n, 4, generator=generator) + self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]
'''


PAIRS = '''"""Sequences whose labels are themselves."""
import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    def __init__(self, n: int = 32, seed: int = 0):
        self.ids = torch.randint(1, 64, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
'''

T5_PIPELINE = """\
## T5 under the pipeline trainer
-- extends 'configs/train.yaml'
-- from 'trainers/pipeline_trainer.yaml' import trainer_class, trainer_args_class, trainer_kind, pipeline_args

-- block model
model: &model !partial:transformers:T5ForConditionalGeneration
    - !singleton:transformers:T5Config {vocab_size: 64, d_model: 16, d_kv: 8, d_ff: 32, num_layers: 2, num_heads: 2}
-- endblock

-- block datasets
train_dataset: &train_dataset !singleton:./data.py:Pairs {}
eval_dataset: &eval_dataset !singleton:./data.py:Pairs {seed: 1}
-- endblock

-- block trainer_args
    == super()
== pipeline_args()
-- endblock
"""


def test_a_model_the_pipeline_trainer_refuses_is_located_at_the_users_model_line(tmp_path):
    """Not at base.yaml's trainer arguments: the model is what is refused, and the user's
    config sets it."""
    assert run_forge("new", "t5", "--from", "blank", "-p", str(tmp_path)).returncode == 0
    project = tmp_path / "t5"
    (project / "data.py").write_text(PAIRS)
    config = project / "templates" / "configs" / "t5.yaml"
    config.write_text(T5_PIPELINE)
    line = (
        T5_PIPELINE.splitlines().index(
            "model: &model !partial:transformers:T5ForConditionalGeneration"
        )
        + 1
    )
    stderr = train_fails_before_any_run(project, "t5.yaml", "--nproc", "2")
    assert (
        f"t5.yaml:{line}: model: T5ForConditionalGeneration cannot be split into pipeline "
        "stages: it is an encoder-decoder model" in stderr
    )
    assert "base.yaml" not in stderr


@pytest.mark.slow  # fast representatives: tests/launch/test_preflight.py, tests/train/test_adapters.py
def test_a_plain_pytorch_model_and_tuple_dataset_train_through_the_adapters(tmp_path):
    """`forge new --from blank`, a model.py and data.py as plain PyTorch writes them: the
    pre-run check names TupleCollator, then LossAdapter; with both, it trains, evaluates and
    its checkpoint loads into the plain model."""
    assert run_forge("new", "plain", "--from", "blank", "-p", str(tmp_path)).returncode == 0
    project = tmp_path / "plain"
    (project / "model.py").write_text(PLAIN_MODEL)
    (project / "data.py").write_text(PLAIN_DATA)
    config = project / "templates" / "configs" / "train.yaml"
    edit(config, "model: &model null", "model: &model !partial:./model.py:Net {hidden: 16}")
    edit(
        config,
        "train_dataset: &train_dataset null",
        "train_dataset: &train_dataset !singleton:./data.py:Blobs {}",
    )
    edit(
        config,
        "eval_dataset: &eval_dataset null",
        "eval_dataset: &eval_dataset !singleton:./data.py:Blobs {n: 32, seed: 1}",
    )
    stderr = train_fails_before_any_run(project, dry_run_only=True)
    assert "train.yaml:" in stderr and "train_dataset: batches must be dicts of tensors" in stderr
    assert "data_collator: !singleton:forge.data:TupleCollator {names: [x, y]}" in stderr

    collator = "data_collator: &data_collator !singleton:forge.data:TupleCollator {names: [x, y]}"
    config.write_text(config.read_text() + f"\n-- block collator\n{collator}\n-- endblock\n")
    stderr = train_fails_before_any_run(project, dry_run_only=True)
    assert (
        "Net.forward must return an object with .loss or a dict with 'loss' (got Tensor)" in stderr
    )
    assert "model: !partial:forge.train:LossAdapter {module: !partial:...}" in stderr

    edit(
        config,
        "model: &model !partial:./model.py:Net {hidden: 16}",
        "model: &model !partial:forge.train:LossAdapter\n    module: !partial:./model.py:Net {hidden: 16}",
    )
    steps = ["-D", "max_steps=10", "-D", "eval_steps=10", "-D", "save_steps=10"]
    trained = run_forge("train", "-p", str(project), *steps)
    assert trained.returncode == 0, trained.stderr
    assert "eval at step 10 | eval_loss " in trained.stderr
    run_dir = Path(trained.stdout.splitlines()[0])
    checkpoint = run_dir / "checkpoints" / "checkpoint-000010" / "model.safetensors"
    check = (
        "import sys; from safetensors.torch import load_file; sys.path.insert(0, sys.argv[1]); "
        "from model import Net; Net(16).load_state_dict(load_file(sys.argv[2])); print('ok')"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", check, str(project), str(checkpoint)], capture_output=True, text=True
    )
    assert loaded.stdout.strip() == "ok", loaded.stderr


def test_a_collator_reading_a_column_remove_unused_columns_drops(classifier):
    edit(
        classifier / "data.py",
        '"labels": self.labels[index]}',
        '"labels": self.labels[index], "id": index}',
    )
    (classifier / "collate.py").write_text(
        "import torch\n\n\ndef collate(items):\n"
        "    ids = [item['id'] for item in items]\n"
        "    return {k: torch.stack([i[k] for i in items]) for k in ('features', 'labels')}\n"
    )
    config = classifier / "templates" / "configs" / "train.yaml"
    block = "data_collator: &data_collator !partial:./collate.py:collate []"
    config.write_text(config.read_text() + f"\n-- block collator\n{block}\n-- endblock\n")
    stderr = train_fails_before_any_run(classifier, dry_run_only=True)
    assert "remove_unused_columns removed the column 'id' before the collator ran" in stderr
    assert "MLPClassifier.forward does not take it" in stderr
    assert "trainer.args.remove_unused_columns: false" in stderr
