"""forge's evaluation gives what Hugging Face's Trainer gives, on the installed transformers, for
models of several families: an encoder-decoder (T5, whose outputs hold its cache), a decoder-only
LM (Llama), an encoder classifier (BERT) and a vision classifier (ViT). The same model, data and
batches go through HF's ``Trainer.evaluation_loop`` and forge's, with a ``compute_metrics``; the
predictions, labels and metrics must be the same, so a rule forge keeps in step with HF (which
outputs are predictions, which are cache) is checked against HF itself, not against a copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from forge.train import Trainer
from tests.train.common import make_args


class Items(Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    items = [
        {"input_ids": torch.randint(1, 64, (6,), generator=g),
         "labels": torch.randint(1, 64, (4,), generator=g)}
        for _ in range(6)
    ]  # fmt: skip
    return T5ForConditionalGeneration(config), items


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(6):
        ids = torch.randint(1, 64, (8,), generator=g)
        items.append({"input_ids": ids, "labels": ids.clone()})
    return LlamaForCausalLM(config), items


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    items = [
        {"input_ids": torch.randint(1, 64, (8,), generator=g),
         "labels": torch.randint(0, 3, (), generator=g)}
        for _ in range(6)
    ]  # fmt: skip
    return BertForSequenceClassification(config), items


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_labels=3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    items = [
        {"pixel_values": torch.randn(3, 8, 8, generator=g),
         "labels": torch.randint(0, 3, (), generator=g)}
        for _ in range(6)
    ]  # fmt: skip
    return ViTForImageClassification(config), items


def metrics(prediction):
    predictions = prediction.predictions
    first = predictions[0] if isinstance(predictions, tuple) else predictions
    parts = len(predictions) if isinstance(predictions, tuple) else 1
    return {"mean": float(np.mean(first)), "parts": float(parts)}


def same(a, b) -> None:
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), (type(a), type(b))
        for x, y in zip(a, b, strict=True):
            same(x, y)
        return
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", [t5, llama, bert, vit], ids=["t5", "llama", "bert", "vit"])
def test_evaluation_gives_what_hugging_faces_trainer_gives(family, tmp_path):
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFArguments

    torch.manual_seed(0)
    model, items = family()
    model.eval()
    dataset = Items(items)
    hf = HFTrainer(
        model=model,
        args=HFArguments(
            output_dir=str(tmp_path / "hf"), per_device_eval_batch_size=3, report_to="none",
            use_cpu=True, disable_tqdm=True,
        ),
        eval_dataset=dataset,
        compute_metrics=metrics,
    )  # fmt: skip
    theirs = hf.evaluation_loop(hf.get_eval_dataloader(), "eval", prediction_loss_only=False)
    args = make_args(tmp_path / "forge", per_device_eval_batch_size=3, eval_strategy="no")
    trainer = Trainer(model, args, dataset, eval_dataset=dataset, compute_metrics=metrics)
    ours = trainer.evaluation_loop(dataset, "eval", prediction_loss_only=False)
    same(theirs.predictions, ours.predictions)
    same(theirs.label_ids, ours.label_ids)
    for key in ("eval_mean", "eval_parts", "eval_loss"):
        assert ours.metrics[key] == pytest.approx(theirs.metrics[key], rel=1e-5), key
