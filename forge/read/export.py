"""``forge export``: one Hugging Face model directory from any forge checkpoint.

A checkpoint's weights may be one ``model.safetensors``, shards of ``save_pretrained``, or one
file per pipeline stage with an index. The export holds the same tensors, bit for bit, in the
layout ``save_pretrained`` writes (``model.safetensors``, sharded with an index past
``max_shard_size``), beside the model config, generation config and tokenizer files, and none
of the training state, so ``from_pretrained`` of the config's architecture loads it.

The weights must be the ones the config's architecture class has (by name and shape, built on
the meta device; forge.checkpoint.hf): a directory of other names would load as an untrained
model, so it is refused, naming the mismatch. A checkpoint of a module that holds one
transformers model (a user's wrapper) exports that model, under its own names, when the
wrapper has no weights of its own; ``submodule`` exports it even then.

A module that neither is nor holds a transformers model (the user's own ``nn.Module``) has no
Hugging Face form: its export is its state dict, every name of ``model.state_dict()`` (a tied
weight under each of its names, buffers as saved) in ``model.safetensors`` (sharded with an
index past ``max_shard_size``), beside the tokenizer files and without a ``config.json``, so
``model.load_state_dict(load_file(OUT / "model.safetensors"), strict=True)`` takes it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from forge.checkpoint.hf import CONFIG_NAME, GENERATION_CONFIG_NAME
from forge.checkpoint.io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, WEIGHTS_INDEX_NAME
from forge.checkpoint.layout import MANIFEST_NAME
from forge.read.errors import ReadFailure, ReadUsageError
from forge.wrappers import class_label, unwrap_model

logger = logging.getLogger(__name__)

_STATE_SUFFIXES = (".pt",)


def export_checkpoint(
    reader: Any,
    output: str | os.PathLike,
    *,
    force: bool = False,
    max_shard_size: str | int = "5GB",
    submodule: str | None = None,
    ema: bool = False,
    merge_lora: bool = False,
) -> Path:
    """Write the model of the ``reader``'s checkpoint (a forge.read.reader.CheckpointReader)
    to ``output``; returns the checkpoint exported.

    A LoRA checkpoint exports its adapter in peft's layout, or with ``merge_lora`` its base
    with the adapter merged in: a plain model directory that ``from_pretrained`` loads without
    peft (``merge_lora`` on any other checkpoint is refused). A non-empty ``output`` is refused
    unless ``force``; then it is replaced only once the export is complete. ``submodule`` names
    the transformers model inside the checkpoint's model to export alone (``lm`` for a
    wrapper's ``self.lm``). ``ema`` exports the moving average of the weights the checkpoint
    holds (``ema_decay``) in place of the trainable weights, each in its saved dtype; a
    checkpoint without one is refused. When the path the reader was given is a run or a
    project, its newest checkpoint's weights must not be a damaged final save."""
    from forge.runs import damaged_final_weights

    source = reader.path
    if reader.asked.resolve() != source.resolve():  # a run's newest
        damaged = damaged_final_weights(source.parent.parent, source)
        if damaged is not None:
            raise ReadFailure(f"{damaged}; or export {source} for the earlier weights")
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not force:
        raise ReadUsageError(
            f"{output} exists and is not empty; choose a new directory or pass --force to "
            "replace its contents"
        )
    average = _read_average(source) if ema else None
    if (source / ADAPTER_CONFIG).is_file():  # a LoRA checkpoint, or an adapter export
        if ema and not merge_lora:
            raise ReadUsageError(
                f"--ema: {source} is a LoRA checkpoint, whose moving average covers the adapter: "
                "add --merge-lora to export the base with the average merged in, or leave out "
                "--ema to export the adapter's own weights"
            )
        if submodule is not None:
            raise ReadUsageError(
                f"--submodule: {source} holds a LoRA adapter, not a model's weights"
            )
        _stage_and_replace(
            output,
            lambda staging: _write_adapter(reader, staging, merge_lora, max_shard_size, average),
        )
        return source
    if merge_lora:
        raise ReadUsageError(
            f"--merge-lora merges a LoRA adapter into its base, and {source} holds no adapter "
            f"(no {ADAPTER_CONFIG}: it is a full model); export it without --merge-lora"
        )
    weight_files, extras = _classify(source)
    if not _is_transformers_checkpoint(source):
        if submodule is not None:
            raise ReadUsageError(
                f"--submodule {submodule}: {source}'s model {_class_name(source)}holds no "
                "transformers model to export alone; leave out --submodule to export its state "
                "dict"
            )
        _export_state_dict(source, output, max_shard_size, average, extras)
        return source
    plan = _plan(source, weight_files, submodule)
    counted: list[int] = []

    def write(staging: Path) -> None:
        counted.append(_write_weights(source, staging, max_shard_size, plan.prefix, average))
        plan.write_configs(source, staging)
        for name in extras:
            if name not in (CONFIG_NAME, GENERATION_CONFIG_NAME):
                shutil.copy2(source / name, staging / name)

    _stage_and_replace(output, write)
    count = counted[0]
    where = f" (its {plan.prefix} submodule)" if plan.prefix else ""
    what = "the moving average of " if ema else ""
    logger.info(
        "exported %s%d tensors of a %s%s from %s", what, count, plan.architecture, where, source
    )
    return source


def _stage_and_replace(output: Path, write: Any) -> None:
    """``write(staging)`` into a directory beside ``output`` that takes its place when done."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.export-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        write(staging)
        _replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_adapter(
    reader: Any,
    directory: Path,
    merge: bool,
    max_shard_size: str | int,
    average: dict[str, Any] | None = None,
) -> None:
    """A LoRA checkpoint's adapter (peft's files, the config naming its base) or, with
    ``merge``, its merged model (``average``: the adapter's moving average merged in place of
    its weights); the tokenizer files either way, never the training state."""
    from forge.checkpoint.adapter import (
        adapter_base,
        base_record_of,
        load_adapter_model,
        named_base,
    )
    from forge.checkpoint.io import save_model_weights
    from forge.checkpoint.weights import hf_directory_problem

    source = reader.path
    keep = [
        p.name
        for p in source.iterdir()
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(_STATE_SUFFIXES)
    ]
    if merge:
        base = adapter_base(source, verify=False)  # its hash is checked where it is read
        problem = hf_directory_problem(base)
        if problem is None:
            merged = load_adapter_model(source, average=average)
            save_model_weights(merged, directory, max_shard_size=max_shard_size)
            what = ""
        else:  # a module of the user's own: built by its run's config, exported as a state dict
            model = unwrap_model(_plain_base_model(reader, base, problem, average))
            _save_state_dict(model.state_dict(), directory, max_shard_size)
            what = f" (a {class_label(model)}, no transformers model: its state dict)"
        keep = [name for name in keep if name not in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)]
        adapter = "the moving average of its LoRA adapter" if average else "its LoRA adapter"
        logger.info("exported the base of %s with %s merged%s", source, adapter, what)
    else:
        logger.info(
            "exported the LoRA adapter of %s (load it with PeftModel.from_pretrained)", source
        )
    for name in keep:
        shutil.copy2(source / name, directory / name)
    if not merge:  # a checkpoint written before its config named the base
        config = json.loads((source / ADAPTER_CONFIG).read_text())
        named = named_base(config, base_record_of(source))
        (directory / ADAPTER_CONFIG).write_text(json.dumps(named, indent=2, sort_keys=True))


def _plain_base_model(reader: Any, base: Path, problem: str, average: Any = None) -> Any:
    """A LoRA checkpoint's base that is no Hugging Face model directory, with the adapter (or
    its moving ``average``) merged: the reader's model, built by its run's config. Refused,
    saying why, for an adapter outside its run (nothing else can build the module)."""
    source = reader.path
    if reader.run_dir is None:
        raise ReadUsageError(
            f"--merge-lora: the base of {source}'s adapter, {base}, is no Hugging Face model "
            f"directory ({problem}): it is a module only its run's config builds, and {source} "
            "is not inside a forge run. Merge from the run's checkpoint, or export the adapter "
            "without --merge-lora and merge it with PeftModel.from_pretrained(model, OUT)"
            ".merge_and_unload() on the model holding the base's weights"
        )
    return reader.model(merge_lora=True, ema=average is not None)


class _Plan:
    """What an export writes: the config (and its architecture) and the name prefix that the
    checkpoint's weights carry in front of that architecture's names ("" for none)."""

    def __init__(self, config: Any, architecture: str, prefix: str, from_file: bool) -> None:
        self.config = config
        self.architecture = architecture
        self.prefix = prefix
        self.from_file = from_file

    def write_configs(self, source: Path, directory: Path) -> None:
        """config.json (the checkpoint's own when it describes these names) and a generation
        config for a model that generates."""
        from forge.checkpoint.hf import architecture_class

        if self.config is None:  # not checked (custom code, quantized): the files as they are
            for name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
                if (source / name).is_file():
                    shutil.copy2(source / name, directory / name)
            return
        verbatim = self.from_file and not self.prefix and self.config.architectures
        if verbatim:
            shutil.copy2(source / CONFIG_NAME, directory / CONFIG_NAME)
        else:
            self.config.architectures = [self.architecture]
            self.config.save_pretrained(directory)
        if not architecture_class(self.config).can_generate():
            return
        if verbatim and (source / GENERATION_CONFIG_NAME).is_file():
            shutil.copy2(source / GENERATION_CONFIG_NAME, directory / GENERATION_CONFIG_NAME)
        else:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(self.config).save_pretrained(directory)


def _plan(source: Path, weight_files: list[Path], submodule: str | None) -> _Plan:
    """Check that the weights are the described architecture's, and find where they sit."""
    from forge.checkpoint.hf import (
        ArchitectureError,
        Unverifiable,
        config_from_dict,
        expected_weights,
        few,
        read_config,
    )
    from forge.checkpoint.weights import weight_shapes

    record = _model_record(source)
    try:
        if (source / CONFIG_NAME).is_file():
            config, hint, from_file = read_config(source / CONFIG_NAME), None, True
        else:  # a module holding a transformers model (_is_transformers_checkpoint)
            config = config_from_dict(record["hf_config"], f"{source / MANIFEST_NAME} (model)")
            hint, from_file = record.get("hf_submodule"), False
        expected = expected_weights(config)
        found = weight_shapes(weight_files)
    except Unverifiable as exc:
        if not (source / CONFIG_NAME).is_file() or submodule is not None:
            raise ReadFailure(f"{source}: cannot export its model: {exc}") from None
        logger.warning(
            "%s: the weights' names are not checked against config.json: %s", source, exc
        )
        return _Plan(None, "model", "", True)
    except ArchitectureError as exc:
        raise ReadFailure(f"{source}: cannot export its model: {exc}") from None
    architecture = expected.architecture
    if submodule is not None:
        prefix = submodule.strip(".")
        if not any(name.startswith(f"{prefix}.") for name in found):
            raise ReadUsageError(
                f"--submodule {submodule}: the checkpoint's model has no weights under "
                f"{prefix!r}" + (f"; its {architecture} is {hint!r}" if hint else "")
            )
    elif hint is not None:
        prefix = hint
    elif expected.mismatch(found) is None:
        prefix = ""
    else:
        prefix = expected.prefix_of(found) or ""
    under = _strip(found, prefix)
    problem = expected.mismatch(under)
    if problem is not None:
        inside = f" (under {prefix!r})" if prefix else ""
        raise ReadFailure(
            f"{source}: its config describes a {architecture}, but the checkpoint's weights"
            f"{inside} are not that class's: {problem}. from_pretrained would load such a "
            "directory as an untrained model, so nothing was exported"
        )
    outside = [name for name in found if prefix and not name.startswith(f"{prefix}.")]
    if outside and submodule is None:
        raise ReadUsageError(  # the export it asks for needs --submodule
            f"{source}: the checkpoint's model holds a {architecture} as {prefix!r} and weights "
            f"outside it ({few(outside)}), which a {architecture} directory cannot hold; pass "
            f"--submodule {prefix} to export the {architecture} alone, without them"
        )
    return _Plan(config, architecture, prefix, from_file)


def _is_transformers_checkpoint(source: Path) -> bool:
    """Whether the checkpoint's model is a transformers model (its ``config.json``) or holds
    one (the manifest's record of it); else it is a module of the user's own."""
    return (source / CONFIG_NAME).is_file() or bool(_model_record(source).get("hf_config"))


def _class_name(source: Path) -> str:
    """``"(model.py:TinyLM) "``: the class the manifest records for the checkpoint's model
    (a project file's as ``file:Class``, another by its name alone), or ""."""
    recorded = str(_model_record(source).get("class") or "")
    if not recorded:
        return ""
    return f"({recorded if ':' in recorded else recorded.rpartition('.')[2]}) "


def _export_state_dict(
    source: Path,
    output: Path,
    max_shard_size: str | int,
    average: dict[str, Any] | None,
    extras: list[str],
) -> None:
    """A plain module's export: its state dict (the moving average in place of the weights it
    covers) as ``model.safetensors``, and the tokenizer files."""
    from forge.checkpoint.weights import read_state_dict

    def write(staging: Path) -> None:
        tensors = read_state_dict(source)
        if average is not None:
            from forge.train.ema import with_ema_weights

            tensors = with_ema_weights(tensors, average)
        _save_state_dict(tensors, staging, max_shard_size)
        for name in extras:
            shutil.copy2(source / name, staging / name)

    _stage_and_replace(output, write)
    averaged = " (the moving average in place of its weights)" if average is not None else ""
    logger.info(
        "exported the state dict of the model %sof %s%s: it is no transformers model, so the "
        "export is no Hugging Face model directory (no config.json)",
        _class_name(source),
        source,
        averaged,
    )


def _save_state_dict(tensors: dict[str, Any], directory: Path, max_shard_size: str | int) -> None:
    """``tensors`` as ``save_pretrained`` lays weights out, every name kept: tensors that
    share memory (tied names) are written as copies, which ``save_torch_state_dict`` would
    otherwise store once, leaving out names that ``load_state_dict(strict=True)`` needs."""
    from huggingface_hub import save_torch_state_dict

    from forge.checkpoint.io import quiet_hub_saves

    seen: set[int] = set()
    unshared = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        unshared[name] = tensor.clone() if tensor.numel() and storage in seen else tensor
        seen.add(storage)
    with quiet_hub_saves():  # its "successfully saved" names the staging directory
        save_torch_state_dict(
            unshared, directory, max_shard_size=max_shard_size, metadata={"format": "pt"}
        )


def loading_hint(directory: Path) -> str:
    """How to load an export: a LoRA adapter, a Hugging Face directory or a state dict."""
    directory = Path(directory)
    if (directory / ADAPTER_CONFIG).is_file():
        return f"load it with PeftModel.from_pretrained(base_model, {str(directory)!r})"
    if (directory / CONFIG_NAME).is_file():
        return f"load it with {pretrained_loader(directory)}.from_pretrained({str(directory)!r})"
    if (directory / WEIGHTS_INDEX_NAME).is_file():
        return (
            "load it into the model with huggingface_hub.load_torch_model(model, "
            f"{str(directory)!r}, strict=True)"
        )
    return (
        "load it into the model with model.load_state_dict(safetensors.torch.load_file("
        f"{str(directory / 'model.safetensors')!r}), strict=True)"
    )


def pretrained_loader(directory: Path) -> str:
    """The transformers class that loads an exported directory: the Auto class of its task
    (causal LM, sequence classifier), else its architecture (read from config.json as text:
    a config that needs custom code is never run here)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    try:
        data = json.loads((Path(directory) / CONFIG_NAME).read_text())
        architecture = (data.get("architectures") or [""])[0]
        model_type = data.get("model_type")
    except (OSError, ValueError, AttributeError, IndexError):
        return "AutoModel"
    if architecture == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type):
        return "AutoModelForCausalLM"
    if architecture == MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type):
        return "AutoModelForSequenceClassification"
    if not architecture:
        return "AutoModel"
    import transformers

    if hasattr(transformers, architecture):
        return f"transformers.{architecture}"
    return f"{architecture} (the model's own class)"


def _model_record(source: Path) -> dict[str, Any]:
    """What the checkpoint's manifest says of its model (forge.checkpoint.hf.describe_model)."""
    from forge.checkpoint.hf import MODEL_RECORD

    try:
        record = json.loads((source / MANIFEST_NAME).read_text()).get(MODEL_RECORD)
    except (OSError, ValueError, AttributeError):
        return {}
    return record if isinstance(record, dict) else {}


def _strip(names: dict[str, Any], prefix: str) -> dict[str, Any]:
    if not prefix:
        return dict(names)
    cut = len(prefix) + 1
    return {name[cut:]: value for name, value in names.items() if name.startswith(f"{prefix}.")}


def _classify(source: Path) -> tuple[list[Path], list[str]]:
    """The checkpoint's weight files, and the other files a model directory keeps (config,
    generation config, tokenizer); training state and the manifest stay behind."""
    from forge.checkpoint.weights import weight_files

    files, _ = weight_files(source)
    skip = {*(file.name for file in files), WEIGHTS_INDEX_NAME, MANIFEST_NAME}
    extras = sorted(
        p.name
        for p in source.iterdir()
        if p.is_file() and p.name not in skip and not p.name.endswith(_STATE_SUFFIXES)
    )
    return files, extras


def _read_average(source: Path) -> dict[str, Any]:
    """The checkpoint's moving average of the weights, by parameter name."""
    from forge.checkpoint import CheckpointError
    from forge.train.ema import read_ema_state

    try:
        return read_ema_state(source)
    except CheckpointError as exc:
        raise ReadUsageError(f"--ema: {exc}") from None


def _write_weights(
    source: Path,
    directory: Path,
    max_shard_size: str | int,
    prefix: str,
    average: dict[str, Any] | None = None,
) -> int:
    """Every tensor of the checkpoint's weights (those under ``prefix``, without it; the
    moving average in place of those it covers) into ``directory`` as ``save_pretrained``
    lays them out."""
    from huggingface_hub import save_torch_state_dict

    from forge.checkpoint.io import quiet_hub_saves
    from forge.checkpoint.weights import read_weights

    tensors = read_weights(source)
    if average is not None:
        from forge.train.ema import with_ema_weights

        tensors = with_ema_weights(tensors, average)
    tensors = _strip(tensors, prefix)
    with quiet_hub_saves():  # its "successfully saved" names the staging directory
        save_torch_state_dict(
            tensors, directory, max_shard_size=max_shard_size, metadata={"format": "pt"}
        )
    return len(tensors)


def _replace(staging: Path, output: Path) -> None:
    """Put the finished export in place of ``output`` (removing what was there)."""
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output, old)
        os.replace(staging, output)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(staging, output)
