"""A Seq2Seq script ported as written: a BART built from its config, trained with
``predict_with_generate``; its evaluations (in training and ``forge evaluate``) hand
compute_metrics generated ids, ``forge predict`` generates as the run's evaluation did (its
beams and length), and a typo among the BartConfig's keys fails before a run exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_forge

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA_PY = '''
import numpy as np
import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    """Each item's labels: its input ids reversed (a task a tiny BART starts to learn)."""

    def __init__(self, n=48, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 32, (n, 6), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].flip(0)}


def generated(prediction):
    """What compute_metrics is given: generated ids padded to the generation's length."""
    predictions, labels = prediction.predictions, prediction.label_ids
    return {"generated_length": float(predictions.shape[1]), "label_length": float(labels.shape[1])}
'''

CONFIG = """\
-- extends 'configs/train.yaml'
-- block model
.model_config: &model_config !singleton:transformers:BartConfig
    vocab_size: 32
    d_model: 16
    {encoder_layers}: 1
    decoder_layers: 1
    encoder_attention_heads: 2
    decoder_attention_heads: 2
    encoder_ffn_dim: 32
    decoder_ffn_dim: 32
    max_position_embeddings: 32
    pad_token_id: 1
    bos_token_id: 0
    eos_token_id: 2
    decoder_start_token_id: 2
    forced_eos_token_id: null
model: &model !partial:transformers:BartForConditionalGeneration
    - *model_config
-- endblock
-- block datasets
train_dataset: &train_dataset !singleton:./data.py:Pairs {{}}
eval_dataset: &eval_dataset !singleton:./data.py:Pairs {{n: 8, seed: 1}}
-- endblock
-- block trainer
    == super()
    compute_metrics: !partial:./data.py:generated []
-- endblock
-- block trainer_args
    == super()
    max_steps: 4
    per_device_train_batch_size: 8
    per_device_eval_batch_size: 4
    eval_steps: 2
    save_steps: 2
    report_to: none
    predict_with_generate: true
    generation_max_length: 9
    generation_num_beams: 2
-- endblock
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seq2seq")
    assert run_forge("new", "s2s", "--from", "blank", "-p", str(root)).returncode == 0
    project = root / "s2s"
    (project / "data.py").write_text(DATA_PY)
    configs = project / "templates" / "configs"
    (configs / "bart.yaml").write_text(CONFIG.format(encoder_layers="encoder_layers"))
    (configs / "typo.yaml").write_text(CONFIG.format(encoder_layers="encoder_layres"))
    return project


def test_a_typo_among_a_bart_configs_keys_fails_before_the_run_exists(project):
    result = run_forge("train", "typo", "-p", str(project))
    assert result.returncode == 2, result.stderr
    assert "typo.yaml:6: .model_config.encoder_layres: BartConfig() has no setting " in (
        result.stderr
    )
    assert "did you mean 'encoder_layers'?" in result.stderr
    assert not (project / "output" / "typo").exists()


def test_a_seq2seq_run_evaluates_and_predicts_by_generating(project, tmp_path):
    result = run_forge("train", "bart", "-p", str(project))
    assert result.returncode == 0, result.stderr
    run = Path(result.stdout.strip().splitlines()[-1])
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_generated_length" in r]
    assert [r["step"] for r in evals] == [2, 4]
    # 9 tokens at most, padded to the generation config's max_length (BART's default: 20);
    # the labels are padded alike: generated ids, not 6 positions of logits
    assert {(r["eval_generated_length"], r["eval_label_length"]) for r in evals} == {(20.0, 20.0)}
    assert all(r["eval_loss"] > 0 for r in evals)  # the loss is still computed

    evaluated = run_forge("evaluate", str(run), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    metrics = json.loads(evaluated.stdout)
    assert metrics["eval_generated_length"] == 20.0
    assert metrics["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)

    inputs = tmp_path / "ids.jsonl"
    inputs.write_text('{"input_ids": [5, 6, 7, 8, 9, 10]}\n{"input_ids": [11, 12, 13]}\n')
    output = tmp_path / "out.jsonl"
    predicted = run_forge("predict", str(run), "--input", str(inputs), "--output", str(output))
    assert predicted.returncode == 0, predicted.stderr
    assert "generating as the run's evaluation did" in predicted.stderr
    assert "num_beams=2, max_length=9" in predicted.stderr
    rows = [json.loads(x) for x in output.read_text().splitlines()]
    assert len(rows) == 2
    # max_length 9 counts the decoder's start token, which the prediction leaves out
    assert all(0 < len(r["prediction"]) <= 8 for r in rows), rows
