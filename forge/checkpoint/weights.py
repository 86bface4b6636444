"""Reading a checkpoint's model weights: the one reader the trainers, ``forge export``,
``forge generate``, ``forge evaluate`` and ``forge predict`` use.

A checkpoint's weights are Hugging Face's safetensors layout: ``model.safetensors``, or shards
named in ``model.safetensors.index.json`` (``save_pretrained``'s shards, or the pipeline
trainer's one file per stage, all keyed by the unsplit model's names). :func:`weight_files`
finds them, :func:`read_weights` reads their tensors, :func:`load_model_weights` puts them into
a model by name (bit-exact; a pipeline stage reads only its own names),
:func:`load_adapter_weights` puts a LoRA checkpoint's adapter (peft's layout) into a peft
model, :func:`load_pretrained` builds a Hugging Face directory's model and fills it that way, and
:func:`hf_directory_problem` says whether ``from_pretrained`` of the directory's config would
load them in full (forge.checkpoint.hf knows which names an architecture has), and
:func:`checkpoint_tokenizer` reads the tokenizer saved beside them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.checkpoint.hf import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    ArchitectureError,
    Unverifiable,
    expected_for_config_text,
    few,
    is_hf_model,
)
from forge.checkpoint.io import (
    ADAPTER_WEIGHTS,
    CheckpointError,
    no_hf_progress_bars,
    read_safetensors_header,
    weight_files,
)
from forge.checkpoint.layout import SHARDS_METADATA
from forge.wrappers import class_label, is_peft_model, unwrap_model

if TYPE_CHECKING:  # torch is imported where used: finding weight files needs none of it
    import torch
    from torch import nn


def load_model_weights(
    model: nn.Module,
    checkpoint_dir: str | os.PathLike,
    *,
    strict: bool = True,
    subset: bool = False,
) -> None:
    """Load a checkpoint's safetensors weights into ``model`` (unwrapped first), bit-exact.

    Reads ``model.safetensors``, a sharded ``model.safetensors.index.json`` (any file names, so
    per-stage files of the pipeline trainer load too) or, failing both, every
    ``model*.safetensors``. Tied weights stored once count as present. With ``strict``, any
    other missing or unexpected key is a CheckpointError.

    A peft model (LoRA) gets the directory's adapter (forge.checkpoint.adapter).

    ``subset``: the model holds part of the checkpoint's model (a pipeline stage, whose
    parameters keep the full model's names). Only its own names are read, from whichever files
    hold them; the checkpoint's other names are not unexpected, and with ``strict`` every name
    of the model must be there.
    """
    directory = Path(checkpoint_dir)
    model = unwrap_model(model)
    if is_peft_model(model):  # a LoRA run's checkpoints hold only the adapter
        load_adapter_weights(model, directory)
        return
    from forge.checkpoint.sharded import has_dtensors, load_sharded_weights, tied_names

    if has_dtensors(model.parameters()):  # sharded (FSDP2): each rank reads its own rows
        load_sharded_weights(model, directory, strict=strict)
        return
    files, aliases = weight_files(directory)
    expected = model.state_dict()
    tied = tied_names(model)
    # a skeleton on the meta device (a pipeline's plan) takes no values: names and shapes only
    skeleton = bool(expected) and all(t.is_meta for t in expected.values())
    loaded = _read_files(files, set(expected) if subset else None, shapes_only=skeleton)

    missing = set()
    for name in expected:
        if name in loaded:
            continue
        if aliases.get(name) in loaded or any(other in loaded for other in tied.get(name, ())):
            continue
        missing.add(name)
    unexpected = set() if subset else set(loaded) - set(expected)
    if is_hf_model(model):
        for attr, keys in (
            ("_keys_to_ignore_on_load_missing", missing),
            ("_keys_to_ignore_on_load_unexpected", unexpected),
        ):
            for pattern in getattr(model, attr, None) or ():
                keys.difference_update({k for k in keys if re.search(pattern, k)})
    if (missing or unexpected) and is_hf_model(model) and not subset:
        # transformers may keep weights in memory under other names than on disk (fused MoE
        # experts); its own loader knows the conversion.
        _load_hf_converted(model, directory, strict=strict)
        return
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys: {few(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {few(unexpected)}")
        raise CheckpointError(
            f"{directory}: weights do not match {class_label(model)} ({'; '.join(parts)})"
        )
    try:
        model.load_state_dict({k: v for k, v in loaded.items() if k in expected}, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(
            f"{directory}: weights do not fit {class_label(model)}: {exc}"
        ) from exc


def load_adapter_weights(model: nn.Module, directory: Path) -> None:
    """Put a directory's adapter (``adapter_model.safetensors``) into peft ``model``, bit-exact;
    every adapter name must match."""
    load_adapter_state(model, read_adapter_state(Path(directory)), str(directory))


def read_adapter_state(directory: Path) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapter tensors (``adapter_model.safetensors``), on the CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointError(
            f"{directory}: no {ADAPTER_WEIGHTS}; a LoRA run loads only adapter checkpoints (a "
            "full model's weights are its base: give it as base_model)"
        )
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from exc


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from forge.checkpoint.hf import few

    model = unwrap_model(model)
    expected = get_peft_model_state_dict(model)
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing or unexpected:
        parts = [f"missing: {few(missing)}"] if missing else []
        parts += [f"unexpected: {few(unexpected)}"] if unexpected else []
        raise CheckpointError(
            f"{where}: the adapter does not match this model's ({'; '.join(parts)}); was it "
            "trained with other lora_target_modules, modules_to_save or base?"
        )
    shapes = [k for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if shapes:
        raise CheckpointError(
            f"{where}: adapter tensors of other shapes ({few(shapes)}): was it trained with "
            "another lora_r or base?"
        )
    set_peft_model_state_dict(model, state)


def read_weights(
    directory: str | os.PathLike, names: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a directory's weight files (only those in ``names``, when given), on the
    CPU, under the names they are saved with. A name stored in two files with other values is
    a CheckpointError (which one is the model's?); tied copies stored twice are one tensor."""
    files, _ = weight_files(Path(directory))
    return _read_files(files, names)


def read_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every name of the saved model's ``state_dict``, on the CPU: ``read_weights``, and each
    tied name that the save stored once (the safetensors metadata or the index names it) as a
    copy of its tensor, so ``load_state_dict(strict=True)`` of the model takes the result."""
    files, aliases = weight_files(Path(directory))
    tensors = _read_files(files, None)
    for file in files:
        metadata = read_safetensors_header(file).get("__metadata__") or {}
        aliases.update({k: v for k, v in metadata.items() if isinstance(v, str)})
    for name, stored in aliases.items():
        if name not in tensors and stored in tensors:
            tensors[name] = tensors[stored].clone()
    return tensors


def _read_files(
    files: list[Path], names: set[str] | None, shapes_only: bool = False
) -> dict[str, torch.Tensor]:
    """The tensors of ``files`` (those in ``names``; all for None); ``shapes_only``: meta
    tensors of their shapes, read from the headers."""
    import torch

    from forge.checkpoint.sharded import RowReader, is_sharded

    if files and is_sharded(files[0]):  # every rank's rows of each tensor, put back whole
        reader = RowReader(files[0].parent)
        rows = {n: reader.read(n) for n in sorted(reader.names()) if names is None or n in names}
        return {n: t.to("meta") for n, t in rows.items()} if shapes_only else rows
    from safetensors import SafetensorError, safe_open

    loaded: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if names is not None and key not in names:
                        continue
                    if shapes_only:
                        shape = handle.get_slice(key).get_shape()
                        loaded[key], where[key] = torch.empty(shape, device="meta"), file
                        continue
                    tensor = handle.get_tensor(key)
                    if key in loaded and not torch.equal(loaded[key], tensor):
                        raise CheckpointError(
                            f"{file}: holds {key} again, with other values than "
                            f"{where[key].name}: which one is the model's?"
                        )
                    loaded[key], where[key] = tensor, file
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from exc
    return loaded


def _load_hf_converted(model: nn.Module, directory: Path, *, strict: bool) -> None:
    """Load through ``from_pretrained`` (which converts saved names), then copy exactly."""
    dtype = next(model.parameters()).dtype
    try:
        with no_hf_progress_bars():
            loaded, info = type(model).from_pretrained(
                directory, config=model.config, dtype=dtype, output_loading_info=True
            )
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{directory}: cannot load weights into {class_label(model)}: {exc}"
        ) from exc
    problems = {
        k: v
        for k, v in info.items()
        if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    if strict and problems:
        parts = "; ".join(f"{k.replace('_', ' ')}: {few(map(str, v))}" for k, v in problems.items())
        raise CheckpointError(f"{directory}: weights do not match {class_label(model)} ({parts})")
    state = loaded.state_dict()
    try:
        model.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{directory}: weights do not fit {class_label(model)}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------------------------
# whether from_pretrained would load them


def weight_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor name in safetensors ``files`` with its shape, read from their headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        header = read_safetensors_header(file)
        metadata = header.get("__metadata__") or {}
        layout = json.loads(metadata.get(SHARDS_METADATA, "{}"))  # a rank's rows: whole shapes
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(layout[name][1:] if name in layout else info["shape"])
    return shapes


def directory_mismatch(directory: Path, weight_files: Iterable[Path]) -> str | None:
    """Why ``directory``'s ``config.json`` does not describe its weights, or None (also when
    that cannot be checked here: custom model code, quantized weights)."""
    path = directory / CONFIG_NAME
    try:
        expected = expected_for_config_text(path.read_text())
    except OSError as exc:
        return f"{path}: unreadable ({exc})"
    except Unverifiable:
        return None
    except ArchitectureError as exc:
        return str(exc)
    problem = expected.mismatch(weight_shapes(weight_files))
    return f"its weights are not {expected.architecture}'s ({problem})" if problem else None


def hf_directory_problem(directory: Path) -> str | None:
    """Why ``from_pretrained`` would not load ``directory``'s weights in full (no config.json,
    or weights that are not its architecture's), or None when it would."""
    if not (Path(directory) / CONFIG_NAME).is_file():
        return f"it has no {CONFIG_NAME}"
    try:
        files, _ = weight_files(Path(directory))
    except CheckpointError as exc:
        return str(exc)
    return directory_mismatch(Path(directory), files)


def load_pretrained(directory: str | os.PathLike, auto_class: Any) -> nn.Module:
    """The transformers model a Hugging Face directory (a checkpoint's, an export) holds, for
    generate and predict: built from its ``config.json`` with ``auto_class``
    (``AutoModelForCausalLM``, ..., or the architecture's class), in the dtype the config records, and filled by
    :func:`load_model_weights`, the reader the trainers use (every name checked, bit-exact),
    not by ``from_pretrained``'s own loader. Its generation config comes with it."""
    import torch
    from transformers import AutoConfig, GenerationConfig

    directory = Path(directory)
    config = AutoConfig.from_pretrained(directory)
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    # an Auto class, or the architecture's own class (whose builder is _from_config)
    build = getattr(auto_class, "from_config", None) or auto_class._from_config
    with no_hf_progress_bars():
        model = build(config, dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32)
    load_model_weights(model, directory, strict=True)
    if model.can_generate() and (directory / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


def checkpoint_tokenizer(checkpoint: Path) -> Any:
    """The tokenizer saved in a checkpoint (the trainer's), or a clear refusal."""
    from transformers import AutoTokenizer

    if not any(
        (checkpoint / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise CheckpointError(
            f"{checkpoint} holds no tokenizer files; give the trainer a tokenizer to save"
        )
    return AutoTokenizer.from_pretrained(checkpoint)
