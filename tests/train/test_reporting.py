"""What training reports and what it keeps quiet: Hugging Face's end-of-training summary, no
tokens/s for a model without tokens, no library chatter at every checkpoint or loss."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from forge.train import Trainer
from tests.train.common import SEQ_LEN, make_args, make_trainer

SUMMARY_KEYS = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_loss",
    "epoch",
}


def rate(count, runtime):
    """``count / runtime`` as the summary computes it: from the unrounded runtime, while
    ``train_runtime`` is logged rounded to 4 decimals (HF's rule), so a run of a few
    milliseconds differs by up to half of 1e-4 s from the logged one."""
    return pytest.approx(count / runtime, rel=1e-3 + 0.5e-4 / runtime)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class Points(Dataset):
    """``n`` seeded points with a regression target: items without any token."""

    def __init__(self, n: int = 40, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.features = torch.randn(n, 3, generator=generator)
        self.targets = self.features.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "labels": self.targets[index]}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, features, labels=None):
        prediction = self.linear(features)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


def test_training_ends_with_hf_summary_in_the_log_metrics_jsonl_and_train_output(tmp_path, caplog):
    args = make_args(
        tmp_path, max_steps=6, logging_steps=3, gradient_accumulation_steps=2, report_to="none"
    )
    trainer = make_trainer(args)  # a tiny Llama: Hugging Face's flops estimate applies
    with caplog.at_level(logging.INFO, logger="forge.train"):
        output = trainer.train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    summary = records[-1]
    assert set(summary) == {"step", "total_flos", *SUMMARY_KEYS}
    assert summary["step"] == 6 and summary["epoch"] == trainer.state.epoch
    samples = 6 * 2 * args.per_device_train_batch_size  # steps x accumulation x batch
    runtime = summary["train_runtime"]
    assert summary["train_samples_per_second"] == rate(samples, runtime)
    assert summary["train_steps_per_second"] == rate(6, runtime)
    losses = [r["loss"] for r in records if "loss" in r]  # two logs of three steps each
    assert summary["train_loss"] == pytest.approx(sum(losses) / len(losses))
    params = trainer.model.num_parameters(exclude_embeddings=True)
    assert summary["total_flos"] == 6 * samples * SEQ_LEN * params  # HF: 6 x tokens x params
    assert {k: output.metrics[k] for k in SUMMARY_KEYS | {"total_flos"}} == {
        k: summary[k] for k in SUMMARY_KEYS | {"total_flos"}
    }
    logged = [
        r.getMessage() for r in caplog.records if "train_samples_per_second" in r.getMessage()
    ]
    assert len(logged) == 1 and logged[0].startswith("trained to step 6 | train_runtime ")


def test_a_resumed_run_summarises_its_own_steps_and_keeps_counting_flops(tmp_path):
    args = make_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    first = make_trainer(args)
    first.train()
    flos_first = first.state.total_flos
    assert flos_first > 0
    resumed = make_trainer(make_args(tmp_path, max_steps=8))
    output = resumed.train(resume_from_checkpoint=True)
    runtime = output.metrics["train_runtime"]
    samples = 5 * args.per_device_train_batch_size  # steps 4-8 only
    assert output.metrics["train_samples_per_second"] == rate(samples, runtime)
    assert output.metrics["train_steps_per_second"] == rate(5, runtime)
    assert output.metrics["total_flos"] == pytest.approx(flos_first * 8 / 3)  # the whole run


def test_a_model_without_tokens_logs_no_tokens_per_second_and_no_flops(tmp_path):
    args = make_args(tmp_path, max_steps=4, logging_steps=2, per_device_train_batch_size=5)
    output = Trainer(Regressor(), args, Points()).train()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    logs = [r for r in records if "loss" in r]
    assert len(logs) == 2
    assert all("tokens_per_second" not in r for r in records)
    assert set(records[-1]) == {"step", *SUMMARY_KEYS}  # no flops estimate for this model
    runtime = output.metrics["train_runtime"]
    assert output.metrics["train_samples_per_second"] == rate(20, runtime)


def test_checkpoints_of_a_plain_model_log_no_hub_save_lines(tmp_path, caplog):
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    with caplog.at_level(logging.DEBUG):
        Trainer(Regressor(), args, Points()).train()
    assert (tmp_path / "checkpoints" / "checkpoint-000004" / "model.safetensors").is_file()
    chatter = [r.getMessage() for r in caplog.records if "successfully saved" in r.getMessage()]
    assert chatter == []


def test_a_causal_lm_whose_class_names_no_loss_trains_without_the_loss_type_warning(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.loss.loss_utils import ForCausalLMLoss

    from forge.data import CausalLMCollator
    from tests.train.common import VOCAB, TokenDataset

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    assert model.loss_type is None  # transformers finds no loss in the class name
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logger = logging.getLogger("transformers")  # does not propagate to the root logger
    hf_logger.addHandler(handler)
    try:
        trainer = Trainer(
            model,
            make_args(tmp_path, max_steps=2),
            TokenDataset(8),
            data_collator=CausalLMCollator(pad_token_id=0),
        )
        trainer.train()
    finally:
        hf_logger.removeHandler(handler)
    assert not [message for message in seen if "loss_type" in message], seen
    assert model.loss_function is ForCausalLMLoss  # the loss it used before, now named
