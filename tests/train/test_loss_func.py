"""``compute_loss_func`` as Hugging Face's Trainer runs it: labels taken out of the batch, the
function called with the outputs, the labels and the label tokens of the whole optimizer step."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM

from forge.data import CausalLMCollator
from forge.train import Trainer, TrainingArgumentsError
from tests.train.common import VOCAB, make_args, tiny_llama_config

STEPS, ACCUMULATION, BATCH = 4, 2, 2


class RaggedTokens(Dataset):
    """Token rows of 3 to 16 tokens: padded micro-batches hold different numbers of labels, so
    a mean over the step's tokens differs from a mean of the micro-batches' means."""

    def __init__(self, n: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 17, (n,), generator=generator)
        self.rows = [torch.randint(3, VOCAB, (int(k),), generator=generator) for k in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


class TokenSumLoss:
    """An HF-style compute_loss_func: the causal-LM token loss summed and divided by
    ``num_items_in_batch``; records what each call was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []  # (labels' size, num_items)

    def __call__(self, outputs, labels, num_items_in_batch=None):
        self.calls.append(
            (int(labels.numel()), None if num_items_in_batch is None else int(num_items_in_batch))
        )
        logits = outputs.logits[:, :-1].float()
        targets = labels[:, 1:]
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
        )
        return loss / num_items_in_batch


def llama() -> LlamaForCausalLM:
    config = tiny_llama_config()
    config.attention_dropout = 0.0
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def settings(output_dir) -> dict:
    return dict(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )


def window_label_counts() -> list[int]:
    """Each optimizer step's label tokens, position 0 of every row left out (shifted)."""
    collate = CausalLMCollator(pad_token_id=0)
    data = RaggedTokens()
    size = BATCH * ACCUMULATION
    counts = []
    for step in range(STEPS):
        rows = [data[i] for i in range(step * size, (step + 1) * size)]
        batches = [collate(rows[i : i + BATCH]) for i in range(0, size, BATCH)]
        counts.append(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
    return counts


def train_forge(tmp_path, model, loss_func, trainer_cls=Trainer, args_cls=None):
    from forge.train import TrainingArguments

    args = (args_cls or TrainingArguments)(**settings(tmp_path), logging_steps=1)
    trainer = trainer_cls(
        model,
        args,
        RaggedTokens(),
        data_collator=CausalLMCollator(pad_token_id=0),
        compute_loss_func=loss_func,
    )
    trainer.train()
    return trainer


def test_compute_loss_func_gets_what_hf_trainer_gives_it_and_trains_alike(tmp_path):
    import transformers
    from accelerate.state import AcceleratorState

    initial = llama()
    ours_func, theirs_func = TokenSumLoss(), TokenSumLoss()
    ours = train_forge(tmp_path / "forge", copy.deepcopy(initial), ours_func)
    theirs = transformers.Trainer(
        model=copy.deepcopy(initial),
        args=transformers.TrainingArguments(**settings(tmp_path / "hf"), logging_steps=1),
        train_dataset=RaggedTokens(),
        data_collator=CausalLMCollator(pad_token_id=0),
        compute_loss_func=theirs_func,
    )
    theirs.train()
    AcceleratorState._reset_state(reset_partial_state=True)

    counts = window_label_counts()
    assert len(set(counts)) > 1  # the windows differ: normalising by the wrong one would show
    # every micro-batch gets its whole window's label tokens, as from HF's Trainer
    assert [n for _, n in ours_func.calls] == [n for n in counts for _ in range(ACCUMULATION)]
    assert ours_func.calls == theirs_func.calls
    ours_weights, theirs_weights = ours.model.state_dict(), theirs.model.state_dict()
    for name, tensor in theirs_weights.items():
        torch.testing.assert_close(ours_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # and training moved: the comparison is not between two untouched models
    moved = initial.state_dict()["lm_head.weight"]
    assert not torch.allclose(ours_weights["lm_head.weight"], moved)


def test_the_accelerate_trainer_runs_compute_loss_func_as_the_plain_one(tmp_path):
    from forge.train import AccelTrainer, AccelTrainingArguments

    initial = llama()
    plain_func, accel_func = TokenSumLoss(), TokenSumLoss()
    plain = train_forge(tmp_path / "plain", copy.deepcopy(initial), plain_func)
    accel = train_forge(
        tmp_path / "accel",
        copy.deepcopy(initial),
        accel_func,
        trainer_cls=AccelTrainer,
        args_cls=AccelTrainingArguments,
    )
    assert accel_func.calls == plain_func.calls
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(accel.model.state_dict()[name], tensor, msg=name)


def test_a_loss_func_without_num_items_returns_a_mean_averaged_over_the_window(tmp_path):
    """cross_entropy(outputs, labels) takes no num_items_in_batch: it is called without it and
    its per-batch mean is averaged over the window, as the model's own loss would be."""
    calls = []

    def mean_loss(outputs, labels):
        calls.append(labels.shape)
        logits = outputs.logits[:, :-1]
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
        )

    initial = llama()
    with_func = train_forge(tmp_path / "func", copy.deepcopy(initial), mean_loss)
    args = make_args(
        tmp_path / "own", **{k: v for k, v in settings(tmp_path).items() if k != "output_dir"}
    )
    own = Trainer(copy.deepcopy(initial), args, RaggedTokens(), data_collator=CausalLMCollator(0))
    own.train()
    assert len(calls) == STEPS * ACCUMULATION
    for name, tensor in own.model.state_dict().items():
        torch.testing.assert_close(with_func.model.state_dict()[name], tensor, msg=name)


class Features(Dataset):
    def __init__(self, n: int = 24, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(3, (n,), generator=generator)
        self.x = torch.randn(n, 4, generator=generator) + self.labels[:, None].float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.labels[index]}


class Logits(nn.Module):
    """A plain model whose forward knows nothing of labels."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x)


def test_a_forward_without_labels_gets_them_through_compute_loss_func(tmp_path):
    """The labels column is kept (remove_unused_columns) and evaluated with: label_names
    default to the 'labels' compute_loss_func is given."""
    seen = []

    def loss(outputs, labels):
        seen.append(labels)
        return nn.functional.cross_entropy(outputs, labels)

    def accuracy(prediction):
        return {
            "accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())
        }

    args = make_args(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=3)
    trainer = Trainer(
        Logits(),
        args,
        Features(),
        eval_dataset=Features(8, seed=1),
        compute_loss_func=loss,
        compute_metrics=accuracy,
    )
    assert trainer.label_names == ["labels"]
    trainer.train()
    assert seen and all(labels is not None and labels.shape == (4,) for labels in seen[:3])
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_accuracy"} <= set(metrics)


def test_a_loss_func_must_return_one_value(tmp_path):
    trainer = Trainer(
        Logits(),
        make_args(tmp_path, max_steps=1),
        Features(),
        compute_loss_func=functools.partial(nn.functional.cross_entropy, reduction="none"),
    )
    with pytest.raises(
        ValueError,
        match=r"must return the loss, a tensor with one value \(got a tensor of shape \(4,\)\)",
    ):
        trainer.train()


def test_the_pipeline_trainer_refuses_compute_loss_func_saying_what_to_use(tmp_path):
    from forge.train import PipelineTrainer

    with pytest.raises(TrainingArgumentsError, match="give it loss_fn\\(logits, labels\\) instead"):
        PipelineTrainer(
            functools.partial(LlamaForCausalLM, tiny_llama_config()),
            make_args(tmp_path),
            RaggedTokens(),
            compute_loss_func=TokenSumLoss(),
        )
