"""Evaluation as Hugging Face's Trainer does it: compute_metrics on gathered predictions, the
loss weighted per sample (per label token for token losses), metric_for_best_model checked
against what the evaluation produced, save_strategy "best"."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
)

from forge.train import Trainer, TrainerCallback, TrainingArguments, TrainingArgumentsError
from forge.train.user_code import UserCodeFailure
from tests.train.common import checkpoint_dir, make_args, make_trainer

WORDS = ["good", "great", "fine", "bad", "awful", "dull", "the", "movie", "was", "and"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", model_max_length=32
    )


class Reviews(Dataset):
    """``n`` tokenized rows of 1-9 random words with a label, plus the raw text (a column the
    model does not take, which remove_unused_columns must drop)."""

    def __init__(self, tokenizer, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rows = []
        for _ in range(n):
            text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 10))))
            label = int(sum(w in ("good", "great", "fine") for w in text.split()) > 1)
            self.rows.append({"text": text, "label": label, **tokenizer(text)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def classifier(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(WORDS) + 4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        id2label={0: "negative", 1: "positive"},
        label2id={"negative": 0, "positive": 1},
    )
    return BertForSequenceClassification(config)


def accuracy(eval_pred) -> dict[str, float]:
    predictions = np.argmax(eval_pred.predictions, axis=-1)
    return {"accuracy": float((predictions == eval_pred.label_ids).mean())}


def forge_classifier_trainer(tmp_path, model, eval_size=50, **overrides) -> Trainer:
    tokenizer = word_tokenizer()
    values = dict(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=8,
        max_steps=2,
        report_to="none",
        use_cpu=True,
    )
    values.update(overrides)
    return Trainer(
        model,
        TrainingArguments(**values),
        train_dataset=Reviews(tokenizer, 64, seed=1),
        eval_dataset=Reviews(tokenizer, eval_size, seed=2),
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )


def test_eval_loss_and_metrics_equal_hf_trainer_on_the_same_weights(tmp_path):
    import transformers
    from accelerate.state import AcceleratorState

    model = classifier()
    trainer = forge_classifier_trainer(tmp_path / "forge", model)
    ours = trainer.evaluate()
    hf = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"),
            per_device_eval_batch_size=8,
            report_to="none",
            use_cpu=True,
        ),
        eval_dataset=[  # HF leaves a torch dataset's text column to the collator
            {k: v for k, v in row.items() if k != "text"} for row in trainer.eval_dataset.rows
        ],
        data_collator=trainer.data_collator,
        compute_metrics=accuracy,
    )
    theirs = hf.evaluate()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert abs(ours["eval_loss"] - theirs["eval_loss"]) < 1e-6
    assert ours["eval_accuracy"] == theirs["eval_accuracy"]
    assert "eval_perplexity" not in ours  # a classifier's loss is no perplexity
    # 50 rows in batches of 8: a mean of batch means would weigh the last 2 rows 4x
    rows = hf.eval_dataset
    with torch.no_grad():
        means = [model(**hf.data_collator(rows[i : i + 8])).loss.item() for i in range(0, 50, 8)]
    assert abs(np.mean(means) - theirs["eval_loss"]) > 1e-4


def test_token_losses_are_weighted_per_label_token(tmp_path):
    """A causal LM's eval loss is the mean over every predicted token, however they batch."""
    from forge.data import CausalLMCollator
    from tests.train.common import TokenDataset, tiny_llama_init

    class Ragged(TokenDataset):  # rows of 4..16 tokens, so batches hold different counts
        def __getitem__(self, index):
            return {"input_ids": self.ids[index][: 4 + index % 13]}

    args = make_args(tmp_path, per_device_eval_batch_size=5)
    trainer = Trainer(
        tiny_llama_init(),
        args,
        Ragged(8),
        eval_dataset=Ragged(23, seed=3),
        data_collator=CausalLMCollator(pad_token_id=0),
    )
    metrics = trainer.evaluate()
    total, tokens = 0.0, 0
    trainer.model.eval()  # the reference without the model's attention dropout, as evaluated
    with torch.no_grad():
        for index in range(23):
            batch = trainer.data_collator([trainer.eval_dataset[index]])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += trainer.model(**batch).loss.item() * n
            tokens += n
    assert metrics["eval_loss"] == pytest.approx(total / tokens, abs=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))


def test_predictions_labels_inputs_and_losses_reach_compute_metrics(tmp_path):
    seen = {}

    def record(eval_pred):
        seen["pred"] = eval_pred
        return {"rows": len(eval_pred.label_ids)}

    trainer = forge_classifier_trainer(
        tmp_path, classifier(), eval_size=21, include_for_metrics=["inputs", "loss"]
    )
    trainer.compute_metrics = record
    metrics = trainer.evaluate()
    pred = seen["pred"]
    assert isinstance(pred.predictions, np.ndarray) and pred.predictions.shape == (21, 2)
    assert pred.label_ids.tolist() == [row["label"] for row in trainer.eval_dataset.rows]
    assert pred.inputs.shape[0] == 21 and (pred.inputs[:, 0] == 2).all()  # [CLS] first
    assert pred.losses.shape == (21,)  # one (batch mean) loss per sample, as HF gives
    assert metrics["eval_rows"] == 21  # compute_metrics' keys get the eval_ prefix
    # eval_accumulation_steps moves batches to host memory on the way: same result
    trainer.args.eval_accumulation_steps = 2
    trainer.evaluate()
    assert np.array_equal(seen["pred"].predictions, pred.predictions)


def test_preprocess_logits_and_prediction_loss_only(tmp_path):
    trainer = forge_classifier_trainer(tmp_path, classifier(), eval_size=10)
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    trainer.compute_metrics = lambda p: {"shape": float(p.predictions.ndim)}
    assert trainer.evaluate()["eval_shape"] == 1.0
    trainer.args.prediction_loss_only = True
    assert "eval_shape" not in trainer.evaluate()


def test_predict_returns_predictions_labels_and_test_metrics(tmp_path):
    trainer = forge_classifier_trainer(tmp_path, classifier(), eval_size=12)
    output = trainer.predict(trainer.eval_dataset)
    assert output.predictions.shape == (12, 2)
    assert output.label_ids.shape == (12,)
    assert {"test_loss", "test_accuracy", "test_runtime"} <= set(output.metrics)


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("accuracy", "produced only eval_loss"),  # no compute_metrics: only the loss
        ("eval_acc", "did you mean 'eval_accuracy'?"),  # a typo
    ],
)
def test_a_best_metric_no_evaluation_produces_is_an_error_at_the_first_evaluation(
    tmp_path, metric, expected
):
    trainer = forge_classifier_trainer(
        tmp_path,
        classifier(),
        eval_size=8,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        metric_for_best_model=metric,
        load_best_model_at_end=True,
    )
    if metric == "accuracy":
        trainer.compute_metrics = None
    with pytest.raises(TrainingArgumentsError) as info:
        trainer.train()
    message = str(info.value)
    assert "trainer.args.metric_for_best_model is" in message
    assert "the evaluation at step 2" in message and expected in message
    assert trainer.state.global_step == 2  # stopped at the first evaluation
    # the step the failure came after is kept (issue 23), recording no metric it lacked
    from forge.checkpoint import read_manifest

    assert read_manifest(tmp_path / "checkpoints" / "checkpoint-000002").metrics == {}


def test_a_compute_metrics_that_fails_in_training_is_named_with_its_evaluation(tmp_path):
    """As the sanity pass names it: the part, the evaluation, and the line of the user's code
    that raised (the launcher adds the config line: tests/launch/test_sanity.py)."""

    def broken(prediction):
        return {"accuracy": 1 / 0}

    trainer = forge_classifier_trainer(
        tmp_path, classifier(), eval_size=8, max_steps=4, eval_strategy="steps", eval_steps=2,
        save_strategy="no",
    )  # fmt: skip
    trainer.compute_metrics = broken
    with pytest.raises(UserCodeFailure) as info:
        trainer.train()
    line = broken.__code__.co_firstlineno + 1
    assert str(info.value) == (
        "trainer.compute_metrics failed while computing the metrics of the evaluation at step 2: "
        f"ZeroDivisionError: division by zero (raised at {__file__}:{line}, in broken)"
    )
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(UserCodeFailure, match="while computing the metrics of eval: Zero"):
        trainer.evaluate()


def test_best_model_by_accuracy_and_save_strategy_best(tmp_path):
    class Scripted(Trainer):
        accuracy = {2: 0.5, 4: 0.8, 6: 0.7, 8: 0.9, 10: 0.6}

        def evaluation_loop(self, dataset, description="eval", prediction_loss_only=None, **kw):
            from transformers.trainer_utils import EvalLoopOutput

            value = self.accuracy[self.state.global_step]
            return EvalLoopOutput(None, None, {"eval_accuracy": value, "eval_loss": 1.0}, 8)

    args = make_args(
        tmp_path,
        max_steps=10,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="best",
        metric_for_best_model="accuracy",
        load_best_model_at_end=True,
        save_final_checkpoint=False,
    )
    trainer = make_trainer(args, eval_size=8, trainer_cls=Scripted)
    trainer.train()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["checkpoint-000002", "checkpoint-000004", "checkpoint-000008"]  # new bests
    assert trainer.state.best_checkpoint == str(checkpoint_dir(tmp_path, 8))
    assert trainer.state.best_metric == 0.9


def test_reduce_lr_on_plateau_steps_on_the_metric(tmp_path):
    class Flat(Trainer):
        def evaluation_loop(self, dataset, description="eval", prediction_loss_only=None, **kw):
            from transformers.trainer_utils import EvalLoopOutput

            return EvalLoopOutput(None, None, {"eval_loss": 1.0}, 8)

    class Lrs(TrainerCallback):
        lrs: list[float] = []

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self.lrs.append(optimizer.param_groups[0]["lr"])

    args = make_args(
        tmp_path,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
    )
    callback = Lrs()
    make_trainer(args, eval_size=8, trainer_cls=Flat, callbacks=[callback]).train()
    # the first evaluation sets the best; each later one without improvement halves the lr
    assert callback.lrs == [1e-3] * 4 + [5e-4] * 2 + [2.5e-4] * 2


def test_remove_unused_columns_drops_the_text_the_model_does_not_take(tmp_path, caplog):
    trainer = forge_classifier_trainer(tmp_path, classifier(), eval_size=8, max_steps=2)
    trainer.train()
    assert "dropping text from the train items" in caplog.text
    kept = forge_classifier_trainer(
        tmp_path, classifier(), eval_size=8, max_steps=2, remove_unused_columns=False
    )
    with pytest.raises(ValueError):  # the padding collator chokes on the string column
        kept.train()


def test_label_smoothing_raises_the_loss_of_a_confident_model(tmp_path):
    model = classifier()
    plain = forge_classifier_trainer(tmp_path, model, eval_size=16).evaluate()["eval_loss"]
    smoothed = forge_classifier_trainer(
        tmp_path, model, eval_size=16, label_smoothing_factor=0.5
    ).evaluate()["eval_loss"]
    assert smoothed != pytest.approx(plain, abs=1e-4)


def test_compute_metrics_must_be_callable(tmp_path):
    with pytest.raises(TypeError, match="trainer.compute_metrics must be a function"):
        Trainer(
            classifier(),
            TrainingArguments(output_dir=str(tmp_path)),
            train_dataset=[{"input_ids": [1]}],
            compute_metrics={"accuracy": 1},
        )


def test_a_dict_of_eval_datasets_is_evaluated_one_by_one(tmp_path):
    trainer = forge_classifier_trainer(tmp_path, classifier(), eval_size=10)
    single = trainer.evaluate()
    other = Reviews(word_tokenizer(), 6, seed=9)
    metrics = trainer.evaluate({"main": trainer.eval_dataset, "other": other})
    assert metrics["eval_main_loss"] == single["eval_loss"]
    assert metrics["eval_main_accuracy"] == single["eval_accuracy"]
    assert {"eval_other_loss", "eval_other_accuracy", "eval_other_runtime"} <= set(metrics)


def test_batch_eval_metrics_calls_compute_metrics_per_batch(tmp_path):
    calls = []

    def running_accuracy(eval_pred, compute_result):
        right = (eval_pred.predictions.argmax(-1) == eval_pred.label_ids).sum().item()
        calls.append((len(eval_pred.label_ids), right, compute_result))
        if compute_result:
            return {"accuracy": sum(c[1] for c in calls) / sum(c[0] for c in calls)}
        return {}

    trainer = forge_classifier_trainer(tmp_path, classifier(), eval_size=20)
    expected = trainer.evaluate()["eval_accuracy"]
    trainer.compute_metrics = running_accuracy
    trainer.args.batch_eval_metrics = True
    metrics = trainer.evaluate()
    assert [(n, last) for n, _, last in calls] == [(8, False), (8, False), (4, True)]
    assert metrics["eval_accuracy"] == expected


def test_label_names_that_match_no_batch_key_are_reported(tmp_path, caplog):
    trainer = forge_classifier_trainer(tmp_path, classifier(), eval_size=8, label_names=["y"])
    assert "eval_accuracy" not in trainer.evaluate()
    assert "compute_metrics was not called: the eval batches hold no labels under ['y']" in (
        caplog.text
    )


class LabelMean(torch.nn.Module):
    """Its loss is the mean label value over the batch's label tokens (not -100), so the
    exact per-token mean of a whole evaluation is known in advance."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, labels=None):
        loss = labels[labels != -100].float().mean() + self.weight
        return {"loss": loss, "logits": input_ids.float()}


class Rows(Dataset):
    """Row ``i``: ``1 + i % 5`` tokens, each labelled ``i``."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, index):
        return {"input_ids": [index] * (1 + index % 5), "labels": [index] * (1 + index % 5)}


def pad_rows(items):
    width = max(len(item["input_ids"]) for item in items)
    return {
        key: torch.tensor([item[key] + [pad] * (width - len(item[key])) for item in items])
        for key, pad in (("input_ids", 0), ("labels", -100))
    }


@pytest.mark.parametrize("with_metrics", [False, True])
def test_eval_loss_is_per_label_token_with_or_without_compute_metrics(tmp_path, with_metrics):
    """The loss weighting does not depend on whether predictions are gathered for
    compute_metrics (it once weighed batches by their samples without compute_metrics)."""
    args = make_args(tmp_path, per_device_eval_batch_size=4)
    metrics = (
        (lambda prediction: {"rows": float(len(prediction.label_ids))}) if with_metrics else None
    )
    trainer = Trainer(
        LabelMean(),
        args,
        Rows(),
        eval_dataset=Rows(),
        data_collator=pad_rows,
        compute_metrics=metrics,
    )
    result = trainer.evaluate()
    lengths = [1 + i % 5 for i in range(11)]
    expected = sum(i * n for i, n in enumerate(lengths)) / sum(lengths)
    assert result["eval_loss"] == pytest.approx(expected, abs=1e-6)
    assert ("eval_rows" in result) == with_metrics
