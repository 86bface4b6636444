"""A port of an HF Trainer script keeps the original's training losses with dropout on, through
and after its evaluations: each evaluation starts a ``DataLoader`` iterator over the eval set,
which draws its base seed from torch's global generator in HF's loop as in forge's, so the
dropout masks of every later step are the same. (The Lightning counterpart is in
test_lightning_equivalence.py; resume stays bit for bit with evaluations: test_resume.py.)"""

from __future__ import annotations

import copy
import json

import torch
from torch.utils.data import Dataset

from forge.train import Trainer, TrainingArguments


class Items(Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def test_a_bart_port_with_dropout_keeps_hf_trainers_losses_across_evaluations(tmp_path):
    from transformers import BartConfig, BartForConditionalGeneration
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFArguments

    config = BartConfig(
        vocab_size=48, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, dropout=0.2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(3, 48, (6,), generator=g),
         "labels": torch.randint(3, 48, (4,), generator=g)}
        for _ in range(32)
    ]  # fmt: skip
    train, evaluation = Items(data[:24]), Items(data[24:])
    torch.manual_seed(0)
    model = BartForConditionalGeneration(config)
    # 6 steps an epoch, an evaluation every 3 steps: steps 7 to 9 follow two evaluations and
    # an epoch's end
    same = dict(
        per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-3,
        max_steps=9, logging_steps=1, eval_strategy="steps", eval_steps=3, save_strategy="no",
        report_to="none", train_sampling_strategy="sequential", optim="adamw_torch", seed=7,
    )  # fmt: skip
    hf = HFTrainer(
        model=copy.deepcopy(model),
        args=HFArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, disable_tqdm=True, **same),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    hf.train()
    theirs = {r["step"]: r["loss"] for r in hf.state.log_history if "loss" in r}
    evaluated = [r["step"] for r in hf.state.log_history if "eval_loss" in r]
    output = tmp_path / "forge"
    args = TrainingArguments(output_dir=str(output), **same)
    Trainer(copy.deepcopy(model), args, train, eval_dataset=evaluation).train()
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    ours = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert evaluated == [3, 6, 9]
    assert sorted(ours) == sorted(theirs) == list(range(1, 10))
    assert ours == theirs  # bit for bit, dropout and all
