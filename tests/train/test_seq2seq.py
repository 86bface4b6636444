"""Evaluation that generates (``predict_with_generate``) gives what Hugging Face's
``Seq2SeqTrainer`` gives on the same model and data: the generated ids ``compute_metrics``
receives, padded as HF pads them (to the generation config's length with the pad id, then with
-100 between batches), the labels padded alike, the metrics and the loss, which is still the
forward's with the labels. Both run here, in-process, on a tiny random BART and T5."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from forge.train import Trainer, TrainingArgumentsError
from tests.train.common import make_args


class Items(Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return BartForConditionalGeneration(config)


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=48, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def items(count: int = 6) -> list[dict]:
    """Full batches of 3, each with as many label tokens: HF's Seq2SeqTrainer averages the
    batches' mean losses, forge the label tokens (docs/trainers.md), the same figure here."""
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(3, 48, (6,), generator=g),
         "labels": torch.randint(3, 48, (4,), generator=g)}
        for _ in range(count)
    ]  # fmt: skip


def metrics(prediction):
    predictions, labels = prediction.predictions, prediction.label_ids
    return {
        "match": float(np.mean(predictions[:, : labels.shape[1]] == labels)),
        "checksum": float(np.sum(predictions * np.arange(1, predictions.shape[1] + 1))),
        "length": float(predictions.shape[1]),
    }


CASES = {  # the model, and the generation arguments both trainers are given
    "bart-max_length-beams": (bart, dict(generation_max_length=6, generation_num_beams=2)),
    "bart-generation_config": (
        bart,
        dict(generation_config={"max_new_tokens": 30, "decoder_start_token_id": 2}),
    ),
    "t5-model_defaults": (t5, {}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_generating_evaluation_gives_what_seq2seq_trainer_gives(case, tmp_path):
    from transformers import GenerationConfig, Seq2SeqTrainer, Seq2SeqTrainingArguments

    torch.manual_seed(0)
    family, given = CASES[case]
    model = family()
    model.eval()
    dataset = Items(items())
    given = dict(given)
    theirs_given = dict(given)
    if "generation_config" in given:
        theirs_given["generation_config"] = GenerationConfig(**given["generation_config"])
    hf = Seq2SeqTrainer(
        model=copy.deepcopy(model),
        args=Seq2SeqTrainingArguments(
            output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=3, report_to="none",
            use_cpu=True, disable_tqdm=True, predict_with_generate=True, **theirs_given,
        ),
        eval_dataset=dataset,
        compute_metrics=metrics,
    )  # fmt: skip
    theirs = hf.evaluate()
    their_prediction = hf.predict(dataset)
    args = make_args(
        tmp_path / "forge", per_device_eval_batch_size=3, predict_with_generate=True, **given
    )
    trainer = Trainer(
        copy.deepcopy(model), args, dataset, eval_dataset=dataset, compute_metrics=metrics
    )
    ours = trainer.evaluate()
    our_prediction = trainer.predict(dataset)
    np.testing.assert_array_equal(our_prediction.predictions, their_prediction.predictions)
    np.testing.assert_array_equal(our_prediction.label_ids, their_prediction.label_ids)
    for key in ("eval_match", "eval_checksum", "eval_length", "eval_loss"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6), key
    assert our_prediction.metrics["test_checksum"] == their_prediction.metrics["test_checksum"]
    assert ours["eval_length"] > 4  # generated ids, padded: not the 4 label positions of logits


def test_generation_arguments_are_checked_and_a_model_that_cannot_generate_is_refused(tmp_path):
    with pytest.raises(TrainingArgumentsError) as error:
        make_args(tmp_path, predict_with_generate=True, generation_num_beams=0)
    assert "trainer.args.generation_num_beams must be a positive integer (got 0)" in str(
        error.value
    )
    args = make_args(tmp_path, predict_with_generate=True)
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(TrainingArgumentsError, match="the model \\(Linear\\) has no generate"):
        Trainer(plain, args, Items([]))
    args = make_args(tmp_path, generation_config=str(tmp_path / "missing"))
    with pytest.raises(TrainingArgumentsError, match="generation_config is '.*missing'"):
        Trainer(bart(), args, Items([]))
