"""``forge evaluate`` and ``forge predict``: use a trained checkpoint from the command line.

``evaluate_checkpoint`` rebuilds the run's trainer from its saved ``config.yaml`` (the same
datasets, collator, ``compute_metrics`` and arguments), loads the checkpoint's weights and
returns ``trainer.evaluate()``'s metrics for one split. ``predict_file`` needs no config: a
checkpoint is a Hugging Face model directory, so a sequence classifier labels each input with
its ``id2label`` class and a causal LM continues each input's text.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forge.errors import RuntimeFailure, UsageError
from forge.generate import model_kind

logger = logging.getLogger(__name__)

__all__ = ["evaluate_checkpoint", "predict_file", "run_of_checkpoint"]


def run_of_checkpoint(checkpoint: Path) -> Path:
    """The run directory holding ``checkpoint`` (``RUN/checkpoints/checkpoint-N``)."""
    run_dir = Path(checkpoint).resolve().parent.parent
    if not (run_dir / "run.json").is_file() or not (run_dir / "config.yaml").is_file():
        raise UsageError(
            f"{checkpoint} is not inside a forge run (no run.json and config.yaml two levels "
            "up); forge evaluate rebuilds the datasets and metrics from the run's config"
        )
    return run_dir


def evaluate_checkpoint(
    checkpoint: Path, split: str = "eval", allow: list[str] = ()
) -> dict[str, float]:
    """The metrics of ``checkpoint`` on the run's ``split``: ``eval`` (the trainer's eval
    dataset), ``train``, or any other NAME whose ``NAME_dataset`` target the config has.

    Metrics are prefixed with the split (``eval_loss``, ``test_accuracy``). Nothing is written
    to the run.
    """
    from forge.config import load_project
    from forge.runs import RunRecord
    from forge.worker import build_variables, load_run_config

    run_dir = run_of_checkpoint(checkpoint)
    record = RunRecord.load(run_dir)
    project = load_project(Path(record.data.get("project") or run_dir.parents[2]))
    cfg = load_run_config(run_dir, project, list(allow))
    # the trainer's own files (metrics.jsonl, ...) go to a scratch directory, not to the run
    with tempfile.TemporaryDirectory(prefix="forge-evaluate-") as scratch:
        variables = build_variables(Path(scratch), project, record.data.get("config", "config"))
        trainer = cfg.build("trainer", variables)
        dataset = _split_dataset(cfg, trainer, split, variables)
        trainer.load_weights(checkpoint)
        return trainer.evaluate(dataset, metric_key_prefix=split)


def _split_dataset(cfg: Any, trainer: Any, split: str, variables: dict[str, Any]) -> Any:
    own = {"eval": trainer.eval_dataset, "train": trainer.train_dataset}
    if own.get(split) is not None:
        return own[split]
    target = f"{split}_dataset"
    if target in cfg.targets:
        return cfg.build(target, variables)
    splits = [name for name, dataset in own.items() if dataset is not None]
    splits += [t.removesuffix("_dataset") for t in cfg.public_targets if t.endswith("_dataset")]
    raise UsageError(
        f"the run's config has no {split!r} split (no {target} target); splits: "
        + ", ".join(dict.fromkeys(splits))
    )


def read_inputs(path: Path, field: str) -> list[dict[str, Any]]:
    """JSON Lines: each line an object with ``field`` (a plain JSON string is taken as it)."""
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise RuntimeFailure(f"cannot read {path}: {err.strerror or err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise RuntimeFailure(f"{path}:{number}: not a JSON line ({err})") from None
        if isinstance(row, str):
            row = {field: row}
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise UsageError(
                f"{path}:{number}: needs a string field {field!r} (found {keys}); "
                "name the text field with --text-field"
            )
        rows.append(row)
    if not rows:
        raise UsageError(f"{path} has no input lines")
    return rows


def predict_file(
    checkpoint: Path,
    inputs: Path,
    output: Path,
    *,
    text_field: str = "text",
    batch_size: int = 32,
    max_new_tokens: int = 50,
    temperature: float = 0.0,
    seed: int = 0,
) -> int:
    """Write one JSON line per input line to ``output``: the input's fields plus
    ``prediction`` (a class label, labels for a multi-label classifier, a number for a
    regressor, the continuation for a causal LM) and, for a classifier, ``score``.
    Returns the number of lines written."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    kind, architecture = model_kind(checkpoint)
    if kind == "other":
        raise UsageError(
            f"{checkpoint} holds a {architecture}; forge predict handles sequence classifiers "
            "(class labels) and causal LMs (generated text)"
        )
    rows = read_inputs(inputs, text_field)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    torch.manual_seed(seed)
    if kind == "classifier":
        results = _classify(checkpoint, tokenizer, rows, text_field, batch_size)
    else:
        results = _continue(
            checkpoint, tokenizer, rows, text_field, batch_size, max_new_tokens, temperature
        )
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    with open(staging, "w", encoding="utf-8") as handle:
        for row, result in zip(rows, results, strict=True):
            handle.write(json.dumps({**row, **result}, ensure_ascii=False) + "\n")
    os.replace(staging, output)
    return len(rows)


def _batches(rows: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def _max_length(tokenizer: Any, model: Any) -> int | None:
    limits = [
        getattr(tokenizer, "model_max_length", None),
        getattr(model.config, "max_position_embeddings", None),
    ]
    limits = [n for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(limits) if limits else None


def _classify(
    checkpoint: Path, tokenizer: Any, rows: list, field: str, batch_size: int
) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()
    config = model.config
    id2label = {int(k): v for k, v in (config.id2label or {}).items()}
    results = []
    for batch in _batches(rows, batch_size):
        encoded = tokenizer(
            [row[field] for row in batch],
            padding=True,
            truncation=True,
            max_length=_max_length(tokenizer, model),
            return_tensors="pt",
        )
        with torch.no_grad():
            logits = model(**encoded).logits.float()
        if config.problem_type == "multi_label_classification":
            chosen = torch.sigmoid(logits) > 0.5
            for row_chosen, probs in zip(chosen, torch.sigmoid(logits), strict=True):
                labels = [id2label.get(i, i) for i in row_chosen.nonzero().flatten().tolist()]
                results.append(
                    {"prediction": labels, "score": [round(p, 6) for p in probs.tolist()]}
                )
        elif config.num_labels == 1:  # a regressor
            results += [{"prediction": value} for value in logits[:, 0].tolist()]
        else:
            probs = torch.softmax(logits, dim=-1)
            score, index = probs.max(dim=-1)
            for i, p in zip(index.tolist(), score.tolist(), strict=True):
                results.append({"prediction": id2label.get(i, i), "score": round(p, 6)})
    return results


def _continue(
    checkpoint: Path,
    tokenizer: Any,
    rows: list,
    field: str,
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer.padding_side = "left"  # generation continues from the right end of each row
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = pad
    results = []
    for batch in _batches(rows, batch_size):
        texts = [row[field] or tokenizer.bos_token or "" for row in batch]
        encoded = tokenizer(texts, padding=True, return_tensors="pt")
        sample = temperature > 0 and math.isfinite(temperature)
        with torch.no_grad():
            output = model.generate(
                **encoded,
                max_new_tokens=max_new_tokens,
                do_sample=sample,
                temperature=temperature if sample else None,
                top_k=None if not sample else 50,
                pad_token_id=pad,
                use_cache=True,
            )
        new = output[:, encoded["input_ids"].shape[1] :]
        results += [{"prediction": tokenizer.decode(ids, skip_special_tokens=True)} for ids in new]
    return results
