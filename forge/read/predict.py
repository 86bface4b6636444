"""``forge evaluate`` and ``forge predict``: what a checkpoint's reader (forge.read.reader) does
for them.

``evaluate_checkpoint`` rebuilds the run's trainer from its saved ``config.yaml`` (the same
datasets, collator, ``compute_metrics`` and arguments), loads the checkpoint's weights and
returns ``trainer.evaluate()``'s metrics for one split, reported at the checkpoint's step.
``predict_file`` labels or continues each input line. A checkpoint that is a Hugging Face model
directory is used through transformers (``id2label`` classes, ``generate``); any other model
(a plain ``nn.Module``, a wrapper) is the reader's: built as its run's training built it, from
the run's config, and given the checkpoint's weights.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forge.read.errors import ReadFailure, ReadUsageError
from forge.read.generation import DEFAULT_NEW_TOKENS, run_generation_keywords
from forge.read.inputs import (
    InputRows,
    check_input_keys,
    has_tokenizer,
    no_tokenizer,
    read_rows,
    row_tensors,
)
from forge.wrappers import class_label

logger = logging.getLogger(__name__)

__all__ = [
    "auto_class",
    "checkpoint_model_label",
    "continue_with_module",
    "evaluate_checkpoint",
    "model_kind",
    "module_logits",
    "module_output",
    "predict_file",
    "run_module",
]


def model_kind(checkpoint: Path) -> tuple[str, str]:
    """(kind, architecture) of a checkpoint's model: kind is "causal_lm", "seq2seq" (an
    encoder-decoder that generates, such as T5ForConditionalGeneration), "classifier" or
    "other", from its ``config.json``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    if not (checkpoint / "config.json").is_file():
        raise ReadFailure(
            f"{checkpoint} has no config.json: it is not a Hugging Face model directory "
            "(a model without a transformers config is used through its project's config)"
        )
    config = AutoConfig.from_pretrained(checkpoint)
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if architecture == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type):
        return "causal_lm", architecture
    if architecture == MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(config.model_type):
        return "seq2seq", architecture
    if architecture == MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type):
        return "classifier", architecture
    return "other", architecture


def evaluate_checkpoint(reader: Any, split: str = "eval", *, ema: bool = False) -> dict[str, float]:
    """The metrics of the ``reader``'s checkpoint (a forge.read.reader.CheckpointReader) on its
    run's ``split``: ``eval`` (the trainer's eval dataset), ``train``, or any other NAME whose
    ``NAME_dataset`` target the config has.

    Metrics are prefixed with the split (``eval_loss``, ``test_accuracy``). Nothing is written
    to the run. A pipeline run's model is evaluated whole, by the plain trainer, in this
    process (its checkpoints load into it). ``ema`` evaluates the moving average of the
    weights the checkpoint holds (``ema_decay``); a checkpoint without one is refused. Which
    weights are evaluated is logged: without ``ema``, a run that evaluated with its average
    (``eval_with_ema``) reported other metrics than its trained weights give, and the log says so.
    """
    from forge.checkpoint import CheckpointError
    from forge.launch.worker import build_variables
    from forge.train.ema import load_ema_weights, read_ema_state
    from forge.train.sanity import one_process_stand_in

    checkpoint = reader.path
    average = None
    if ema:  # before anything is built: a checkpoint without an average is refused at once
        try:
            average = read_ema_state(checkpoint)
        except CheckpointError as exc:
            raise ReadUsageError(f"--ema: {exc}") from None
    if reader.run_dir is None:
        raise ReadUsageError(
            f"{checkpoint} is not inside a forge run (no run.json and config.yaml two levels "
            "up); forge rebuilds the model, datasets and metrics from the run's config"
        )
    cfg = reader.config
    # the trainer's own files (metrics.jsonl, ...) go to a scratch directory, not to the run
    with tempfile.TemporaryDirectory(prefix="forge-evaluate-") as scratch:
        name = reader.record.get("config", "config")
        variables = build_variables(Path(scratch), reader.project, name)
        with one_process_stand_in():  # a pipeline of several processes, built as one stage
            trainer = _one_process_trainer(cfg.build("trainer", variables))
        dataset = _split_dataset(cfg, trainer, split, variables)
        trainer.load_weights(checkpoint)
        if average is not None:
            load_ema_weights(trainer.model, average, str(checkpoint))
        logger.info("%s", _which_weights(trainer.args, ema=average is not None))
        _at_checkpoint_step(trainer, checkpoint)
        return trainer.evaluate(dataset, metric_key_prefix=split)


def _which_weights(args: Any, *, ema: bool) -> str:
    """The log line that says which weights ``forge evaluate`` evaluates."""
    if ema:
        return "evaluating the moving average of the weights it holds (--ema)"
    if getattr(args, "eval_with_ema", False):
        return (
            "evaluating its trained weights, not the moving average of the weights that its run "
            "evaluated with (eval_with_ema: true), so its metrics differ from the run's own; "
            "--ema evaluates the average"
        )
    if getattr(args, "ema_decay", None):
        return "evaluating its trained weights; --ema evaluates the moving average it holds"
    return "evaluating its trained weights"


def _one_process_trainer(trainer: Any) -> Any:
    """``trainer``, or for a pipeline trainer outside its torchrun job (which evaluates only
    inside one) the plain trainer of the same model, data, metrics and arguments."""
    import dataclasses

    from forge.train import Trainer, TrainingArguments

    if trainer.trainer_kind != "pipeline" or trainer.topology.distributed:
        return trainer
    fields = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    args = TrainingArguments(**{name: getattr(trainer.args, name) for name in fields})
    return Trainer(
        trainer.model_init or trainer.model,
        args,
        trainer.train_dataset,
        eval_dataset=trainer.eval_dataset,
        data_collator=trainer.data_collator,
        tokenizer=trainer.tokenizer,
        compute_metrics=trainer.compute_metrics,
        preprocess_logits_for_metrics=trainer.preprocess_logits_for_metrics,
    )


def _at_checkpoint_step(trainer: Any, checkpoint: Path) -> None:
    """Report the evaluation at the checkpoint's step and epoch (its manifest's), not at 0."""
    from forge.checkpoint import CheckpointError, read_manifest

    try:
        manifest = read_manifest(checkpoint)
    except (CheckpointError, OSError, ValueError):
        return  # a plain model directory: no step to report
    trainer.state.global_step = manifest.step
    trainer.state.epoch = float(manifest.epoch or 0.0)


def _split_dataset(cfg: Any, trainer: Any, split: str, variables: dict[str, Any]) -> Any:
    own = {"eval": trainer.eval_dataset, "train": trainer.train_dataset}
    if own.get(split) is not None:
        return own[split]
    target = f"{split}_dataset"
    if target in cfg.targets:
        return cfg.build(target, variables)
    splits = [name for name, dataset in own.items() if dataset is not None]
    splits += [t.removesuffix("_dataset") for t in cfg.public_targets if t.endswith("_dataset")]
    raise ReadUsageError(
        f"the run's config has no {split!r} split (no {target} target); splits: "
        + ", ".join(dict.fromkeys(splits))
    )


def read_inputs(path: Path, field: str) -> list[dict[str, Any]]:
    """JSON Lines: each line an object with ``field`` (a plain JSON string is taken as it), or
    each line an object of model inputs (forge.read.inputs)."""
    return read_rows(path, field).rows


def predict_file(
    reader: Any,
    inputs: Path,
    output: Path,
    *,
    text_field: str = "text",
    batch_size: int = 32,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> int:
    """Write one JSON line per input line to ``output``, by the model of the ``reader``'s
    checkpoint (a forge.read.reader.CheckpointReader): the input's fields plus ``prediction``
    (a class label, labels for a multi-label classifier, a number for a regressor, the
    continuation for a causal LM, the generated text for an encoder-decoder) and, for a
    classifier, ``score``. Returns the number of lines written.

    Lines of text need the checkpoint's tokenizer; lines of model inputs (``{"input_ids":
    [...]}``, ``{"x": [...]}``) are given to the model as they are, one at a time, and a
    generating model's prediction is then the token ids it adds (forge.read.inputs).

    A generating model adds ``max_new_tokens`` tokens (50 when None); where the checkpoint's run
    evaluated by generating (``predict_with_generate``), it generates as that evaluation did:
    ``generation_num_beams`` beams, and ``generation_max_length`` unless ``max_new_tokens`` is
    given (forge/read/generation.py).

    A model that is not a Hugging Face directory's is built from its run's config and fed one
    input at a time (``input_ids``, and ``attention_mask`` when its forward takes one), so its
    answers never depend on padding; what its forward returns (``logits`` of shape
    [batch, classes] or [batch, tokens, vocabulary]) says whether it classifies or continues.
    """
    import torch
    import transformers

    from forge.checkpoint.weights import checkpoint_tokenizer, hf_directory_problem

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    checkpoint = reader.path
    described = _model_directory(checkpoint)
    problem = hf_directory_problem(described)
    if problem is None:
        kind, architecture = model_kind(described)
        if kind == "other":
            raise ReadUsageError(
                f"{checkpoint} holds a {architecture}; forge predict handles sequence "
                "classifiers (class labels), causal LMs and encoder-decoder models such as T5 "
                "(generated text)"
            )
    rows = read_rows(inputs, text_field)
    if rows.text and not has_tokenizer(checkpoint):
        label = architecture if problem is None else checkpoint_model_label(checkpoint)
        raise no_tokenizer(
            checkpoint,
            label,
            f"give each line of {inputs} the model's inputs in place of its {text_field!r}, "
            'e.g. {"input_ids": [1, 2, 3]}',
        )
    if problem is None:
        lengths = run_generation_keywords(checkpoint, max_new_tokens)
        results = _predict_with_directory(
            checkpoint, described, kind, rows, text_field, batch_size, lengths,
            temperature, seed,
        )  # fmt: skip
    else:
        max_new_tokens = DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        model = run_module(reader, problem)
        torch.manual_seed(seed)
        if rows.text:
            tokenizer = checkpoint_tokenizer(checkpoint)
            results = [
                _module_prediction(model, tokenizer, row[text_field], max_new_tokens, temperature)
                for row in rows.rows
            ]
        else:
            check_input_keys(model, rows)
            results = [
                _module_input_prediction(model, rows, index, max_new_tokens, temperature)
                for index in range(len(rows.rows))
            ]
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    with open(staging, "w", encoding="utf-8") as handle:
        for row, result in zip(rows.rows, results, strict=True):
            handle.write(json.dumps({**row, **result}, ensure_ascii=False) + "\n")
    os.replace(staging, output)
    return len(rows.rows)


def _predict_with_directory(
    checkpoint: Path,
    described: Path,
    kind: str,
    rows: InputRows,
    field: str,
    batch_size: int,
    lengths: dict[str, int],
    temperature: float,
    seed: int,
) -> list[dict[str, Any]]:
    """The predictions of a Hugging Face directory's model (or a LoRA base that is one)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from forge.checkpoint.hf import architecture_class

    if not rows.text:  # checked against the class before any weights are read
        cls = architecture_class(AutoConfig.from_pretrained(described))
        check_input_keys(cls, rows, needs=cls.main_input_name)
    model = _load_model(checkpoint, auto_class(kind))
    torch.manual_seed(seed)
    if not rows.text:
        return [
            _directory_input_prediction(model, kind, rows, index, lengths, temperature)
            for index in range(len(rows.rows))
        ]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if kind == "classifier":
        return _classify(model, tokenizer, rows.rows, field, batch_size)
    return _continue(model, tokenizer, rows.rows, field, batch_size, lengths, temperature)


def auto_class(kind: str) -> Any:
    """The transformers Auto class that loads a model of ``model_kind``'s ``kind``."""
    import transformers

    names = {
        "classifier": "AutoModelForSequenceClassification",
        "causal_lm": "AutoModelForCausalLM",
        "seq2seq": "AutoModelForSeq2SeqLM",
    }
    return getattr(transformers, names[kind])


def checkpoint_model_label(checkpoint: Path) -> str:
    """The class of a checkpoint's model as its manifest records it (``model.py:TinyLM``), for
    messages given before the model is built."""
    from forge.checkpoint import CheckpointError, read_manifest

    try:
        recorded = read_manifest(checkpoint).extra.get("model", {}).get("class")
    except (CheckpointError, OSError, ValueError, AttributeError):
        recorded = None
    if not recorded:
        return "model"
    return recorded if ":" in recorded else recorded.rsplit(".", 1)[-1]


def _directory_input_prediction(
    model: Any, kind: str, rows: InputRows, index: int, lengths: dict[str, int], temperature: float
) -> dict[str, Any]:
    """One line of model inputs through a transformers model: its class (a classifier), or
    the token ids it generates (a causal LM: after the input; an encoder-decoder: the decoder's,
    without its start token), the end-of-text token it stops at left out."""
    import torch

    tensors = row_tensors(rows, index, _float_dtype(model))
    if kind == "classifier":
        with torch.no_grad():
            logits = _run(model, tensors, rows, index).logits.float()
        return _class_results(logits, model.config)[0]
    config = model.generation_config
    sample = temperature > 0 and math.isfinite(temperature)
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    with torch.no_grad():
        output = _run(
            model.generate,
            {
                **tensors,
                **lengths,
                "do_sample": sample,
                "temperature": temperature if sample else None,
                "top_k": 50 if sample else None,
                "pad_token_id": pad,
                "use_cache": True,
            },
            rows,
            index,
        )
    new = output[0, 1:] if kind == "seq2seq" else output[0, tensors["input_ids"].shape[1] :]
    eos = config.eos_token_id
    ids = new.tolist()
    if ids and ids[-1] in (eos if isinstance(eos, list) else [eos]):
        ids.pop()  # generation stopped there (one line: no padding after it)
    return {"prediction": ids}


def _run(call: Any, kwargs: dict[str, Any], rows: InputRows, index: int) -> Any:
    """``call(**kwargs)`` for one input line; an error of the model's is reported at the line
    (exit 1), with the shapes it was given."""
    try:
        return call(**kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        import torch

        shapes = ", ".join(
            f"{key} {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
            for key, value in kwargs.items()
            if torch.is_tensor(value)
        )
        raise ReadFailure(
            f"{rows.where(index)}: the model failed on this line's inputs ({shapes}): "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}; "
            "each value is one example without a batch dimension (forge adds it); a key whose "
            "numbers have no point is int64 (write 1.0 for a float)"
        ) from None


def _float_dtype(model: Any) -> Any:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _module_input_prediction(
    model: Any, rows: InputRows, index: int, max_new_tokens: int, temperature: float
) -> dict[str, Any]:
    """One line of model inputs through a module of the user's own: its class or value
    (logits [1, classes]), the token ids a causal LM adds to the line's ``input_ids`` (logits
    [1, tokens, vocabulary]), else the values its forward returns."""
    tensors = row_tensors(rows, index, _float_dtype(model))
    logits = _run(lambda **kw: module_output(model, kw), tensors, rows, index)
    if logits.dim() == 2:
        return _module_class(model, logits)
    ids = tensors.get("input_ids")
    if (
        logits.dim() == 3
        and ids is not None
        and not ids.is_floating_point()
        and logits.shape[1] == ids.shape[-1]
        and logits.shape[-1] > int(ids.max())
    ):  # one score per token of a vocabulary the ids are in: a causal LM
        return {
            "prediction": continue_with_module(
                model, None, ids, max_new_tokens, temperature, logits
            )
        }
    return {"prediction": logits[0].tolist()}


def _model_directory(checkpoint: Path) -> Path:
    """The directory whose config describes the checkpoint's model: its own, or for a LoRA
    checkpoint its base's."""
    from forge.checkpoint.adapter import adapter_base, is_adapter_directory

    return (
        adapter_base(checkpoint, verify=False) if is_adapter_directory(checkpoint) else checkpoint
    )


def _load_model(checkpoint: Path, auto_class: Any) -> Any:
    """A Hugging Face directory's model, or a LoRA checkpoint's base with the adapter merged."""
    from forge.checkpoint.adapter import is_adapter_directory, load_adapter_model
    from forge.checkpoint.weights import load_pretrained

    if is_adapter_directory(checkpoint):
        return load_adapter_model(checkpoint, auto_class)
    return load_pretrained(checkpoint, auto_class)


def run_module(reader: Any, problem: str) -> Any:
    """The reader's model built through its run's config (its checkpoint is no Hugging Face
    directory: ``problem`` says why), a LoRA adapter merged into its base."""
    if reader.run_dir is None:
        raise ReadUsageError(
            f"{reader.path} is not a Hugging Face model directory ({problem}) and is not inside "
            "a forge run whose config.yaml builds its model"
        )
    logger.info("building the model as its run did (%s)", problem)
    return reader.model(merge_lora=reader.is_adapter)


def module_logits(model: Any, input_ids: Any) -> Any:
    """``model``'s logits for one row of ``input_ids``: its forward's ``logits`` (or the
    tensor it returns, or the first of a tuple)."""
    import torch

    parameters = inspect.signature(model.forward).parameters
    kwargs = {"input_ids": input_ids}
    if "attention_mask" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        kwargs["attention_mask"] = torch.ones_like(input_ids)
    if "input_ids" not in parameters and not any(
        p.kind is p.VAR_KEYWORD for p in parameters.values()
    ):
        raise ReadUsageError(
            f"{class_label(model)}.forward takes no input_ids (it takes "
            f"{', '.join(parameters)}); forge predict feeds a tokenized text as input_ids"
        )
    return module_output(model, kwargs)


def module_output(model: Any, kwargs: dict[str, Any]) -> Any:
    """``model(**kwargs)``'s logits (a tensor it returns, the first of a tuple, or a
    ``logits`` entry), as float."""
    import torch

    with torch.no_grad():
        output = model(**kwargs)
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    logits = output if torch.is_tensor(output) else _get(output, "logits")
    if not torch.is_tensor(logits):
        raise ReadUsageError(
            f"{class_label(model)}.forward returned {type(output).__name__} without logits; "
            "forge predict reads its logits (a tensor, or a 'logits' entry)"
        )
    return logits.float()


def _get(output: Any, key: str) -> Any:
    try:
        return output[key]
    except (KeyError, TypeError, IndexError):
        return getattr(output, key, None)


def _module_prediction(
    model: Any, tokenizer: Any, text: str, max_new_tokens: int, temperature: float
) -> dict[str, Any]:
    """One input's prediction by a module: a class (logits [1, classes]) or a continuation
    (logits [1, tokens, vocabulary])."""
    ids = tokenizer(text or tokenizer.bos_token or "", return_tensors="pt")["input_ids"]
    limit = _max_length(tokenizer, model)  # a classifier reads the start, a LM continues the end
    logits = module_logits(model, ids[:, :limit] if limit else ids)
    if logits.dim() == 2:
        return _module_class(model, logits)
    if logits.dim() == 3 and logits.shape[-1] >= len(tokenizer):
        fits = not limit or ids.shape[1] <= limit
        new = continue_with_module(
            model, tokenizer, ids, max_new_tokens, temperature, logits if fits else None
        )
        return {"prediction": tokenizer.decode(new, skip_special_tokens=True)}
    raise ReadUsageError(
        f"{class_label(model)} returned logits of shape {list(logits.shape)}, neither a "
        "classifier's [batch, classes] nor a causal LM's [batch, tokens, vocabulary of "
        f"{len(tokenizer)}]"
    )


def _module_class(model: Any, logits: Any) -> dict[str, Any]:
    """A module's prediction from logits [1, classes]: the class (named by a ``config.id2label``
    the model has) and its score, or the value of a regressor's single output."""
    import torch

    config = getattr(model, "config", None)
    id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()}
    if logits.shape[-1] == 1:  # a regressor
        return {"prediction": logits[0, 0].item()}
    score, index = torch.softmax(logits[0], dim=-1).max(dim=-1)
    return {"prediction": id2label.get(index.item(), index.item()), "score": round(score.item(), 6)}


def continue_with_module(
    model: Any,
    tokenizer: Any,
    ids: Any,
    max_new_tokens: int,
    temperature: float,
    logits: Any = None,
    top_k: int = 50,
) -> list[int]:
    """The tokens a causal LM module adds to ``ids`` (one row): greedy, or sampled from the
    ``top_k`` most likely at ``temperature`` > 0; stops at the end-of-text token (the
    tokenizer's, or without one the model config's, if any). Each step runs the whole sequence
    (a plain module keeps no cache), cut to the model's context length."""
    import torch

    limit = _max_length(tokenizer, model)
    vocabulary = len(tokenizer) if tokenizer is not None else None
    if tokenizer is not None:
        ends = {tokenizer.eos_token_id}
    else:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
        ends = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    sample = temperature > 0 and math.isfinite(temperature)
    new: list[int] = []
    for _ in range(max_new_tokens):
        if logits is None:
            logits = module_logits(model, ids[:, -limit:] if limit else ids)
        last = logits[0, -1, :vocabulary]
        if sample:
            values, indices = torch.topk(last / temperature, min(top_k, last.shape[-1]))
            token = indices[torch.multinomial(torch.softmax(values, dim=-1), 1)].item()
        else:
            token = int(last.argmax().item())
        if token in ends:
            break
        new.append(token)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
        logits = None
    return new


def _batches(rows: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def _max_length(tokenizer: Any, model: Any) -> int | None:
    config = getattr(model, "config", None)
    limits = [
        getattr(tokenizer, "model_max_length", None),
        getattr(config, "max_position_embeddings", None),
        getattr(config, "n_positions", None),
    ]
    limits = [n for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(limits) if limits else None


def _classify(
    model: Any, tokenizer: Any, rows: list, field: str, batch_size: int
) -> list[dict[str, Any]]:
    import torch

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
        results += _class_results(logits, model.config)
    return results


def _class_results(logits: Any, config: Any) -> list[dict[str, Any]]:
    """A transformers classifier's predictions for a batch of logits: the labels above 0.5
    (multi-label), the value (a regressor), or the class and its score."""
    import torch

    id2label = {int(k): v for k, v in (config.id2label or {}).items()}
    if config.problem_type == "multi_label_classification":
        results = []
        for probs in torch.sigmoid(logits):
            chosen = (probs > 0.5).nonzero().flatten().tolist()
            labels = [id2label.get(i, i) for i in chosen]
            results.append({"prediction": labels, "score": [round(p, 6) for p in probs.tolist()]})
        return results
    if config.num_labels == 1:  # a regressor
        return [{"prediction": value} for value in logits[:, 0].tolist()]
    score, index = torch.softmax(logits, dim=-1).max(dim=-1)
    return [
        {"prediction": id2label.get(i, i), "score": round(p, 6)}
        for i, p in zip(index.tolist(), score.tolist(), strict=True)
    ]


def _continue(
    model: Any,
    tokenizer: Any,
    rows: list,
    field: str,
    batch_size: int,
    lengths: dict[str, int],
    temperature: float,
) -> list[dict[str, Any]]:
    """Each text's continuation by a causal LM, or what an encoder-decoder writes for it (the
    text is its encoder's input)."""
    import torch

    encoder_decoder = model.config.is_encoder_decoder
    if not encoder_decoder:
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
                **lengths,
                do_sample=sample,
                temperature=temperature if sample else None,
                top_k=None if not sample else 50,
                pad_token_id=pad,
                use_cache=True,
            )
        new = output if encoder_decoder else output[:, encoded["input_ids"].shape[1] :]
        results += [{"prediction": tokenizer.decode(ids, skip_special_tokens=True)} for ids in new]
    return results
