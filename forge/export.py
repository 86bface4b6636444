"""``forge export``: one Hugging Face model directory from any forge checkpoint.

A checkpoint's weights may be one ``model.safetensors``, shards of ``save_pretrained``, or one
file per pipeline stage with an index. The export holds the same tensors, bit for bit, in the
layout ``save_pretrained`` writes (``model.safetensors``, sharded with an index past
``max_shard_size``), beside the model config, generation config and tokenizer files, and none
of the training state. ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from forge.errors import RuntimeFailure, UsageError

logger = logging.getLogger(__name__)

_STATE_SUFFIXES = (".pt",)
_MANIFEST = "manifest.json"
_INDEX = "model.safetensors.index.json"


def export_model(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    force: bool = False,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write ``checkpoint``'s model to ``output``; returns the checkpoint exported.

    ``checkpoint`` is a checkpoint directory or a run directory (its newest valid
    checkpoint). A non-empty ``output`` is refused unless ``force``; then it is replaced only
    once the export is complete.
    """
    from forge.generate import resolve_checkpoint

    source = resolve_checkpoint(Path(checkpoint))
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not force:
        raise UsageError(
            f"{output} exists and is not empty; choose a new directory or pass --force to "
            "replace its contents"
        )
    if not (source / "config.json").is_file():
        raise RuntimeFailure(
            f"{source} has no config.json: its model is not a Hugging Face model, so there is "
            "no model directory to export (its weights are the checkpoint's safetensors files)"
        )
    weight_files, extras = _classify(source)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.parent / f".{output.name}.export-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        count = _write_weights(weight_files, staging, max_shard_size)
        for name in extras:
            shutil.copy2(source / name, staging / name)
        if "generation_config.json" not in extras:
            _write_generation_config(staging)
        _replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %d tensors from %s to %s", count, source, output)
    return source


def _classify(source: Path) -> tuple[list[Path], list[str]]:
    """The checkpoint's weight files, and the other files a model directory keeps (config,
    generation config, tokenizer); training state and the manifest stay behind."""
    index = source / _INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeFailure(f"{index}: unreadable weight index ({exc})") from exc
    else:
        names = sorted(p.name for p in source.glob("model*.safetensors"))
    if not names:
        raise RuntimeFailure(f"{source}: no model weights (model*.safetensors) to export")
    skip = {*names, _INDEX, _MANIFEST}
    extras = sorted(
        p.name
        for p in source.iterdir()
        if p.is_file() and p.name not in skip and not p.name.endswith(_STATE_SUFFIXES)
    )
    return [source / n for n in names], extras


def _write_weights(files: list[Path], directory: Path, max_shard_size: str | int) -> int:
    """Every tensor of ``files`` into ``directory`` as ``save_pretrained`` lays them out."""
    from huggingface_hub import save_torch_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors = {}
    for file in files:
        try:
            loaded = load_file(file)
        except (SafetensorError, OSError) as exc:
            raise RuntimeFailure(f"{file}: unreadable safetensors file ({exc})") from exc
        clashes = set(tensors) & set(loaded)
        if clashes:
            raise RuntimeFailure(
                f"{file}: holds {sorted(clashes)[:3]} again (another file has them)"
            )
        tensors.update(loaded)
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.WARNING)  # its "successfully saved" names the staging directory
    try:
        save_torch_state_dict(
            tensors, directory, max_shard_size=max_shard_size, metadata={"format": "pt"}
        )
    finally:
        hub_logger.setLevel(level)
    return len(tensors)


def _write_generation_config(directory: Path) -> None:
    """A generation config from the model config, for a checkpoint that has none."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)


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
