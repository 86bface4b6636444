"""LoRA checkpoints: the adapter alone, in peft's layout, beside the base it was trained on.

A checkpoint of a peft model holds ``adapter_model.safetensors`` (peft's state-dict names,
without the adapter's name) and ``adapter_config.json`` (the peft config as ``save_pretrained``
writes it), so ``PeftModel.from_pretrained(base, CHECKPOINT)`` loads it; never the frozen base.
The base is recorded once per run (``run_NNN/base_model.json``, see forge/train/lora.py) and in
each checkpoint's manifest (``lora_base``: its directory and content hash), so the commands that
use a checkpoint (export, generate, predict) find it and can tell when it changed on disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.checkpoint.hf import MODEL_RECORD, describe_model
from forge.checkpoint.io import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CheckpointError,
    hash_file,
    no_hf_progress_bars,
)
from forge.checkpoint.layout import MANIFEST_NAME
from forge.checkpoint.weights import (
    load_adapter_state,
    load_adapter_weights,
    load_pretrained,
    read_adapter_state,
)
from forge.wrappers import unwrap_model

if TYPE_CHECKING:
    import torch
    from torch import nn

BASE_RECORD = "lora_base"  # the manifest key: {"path": ..., "sha256": ...}


class BaseChanged(CheckpointError):
    """The base a LoRA adapter was trained on is no longer the one on disk."""


def is_adapter_directory(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a peft adapter (a LoRA checkpoint or its export)."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


# ---------------------------------------------------------------------------------------------
# the base's identity


def base_files(directory: Path) -> list[Path]:
    """The files that make a model directory what it is: every top-level file but a forge
    checkpoint's manifest and training state (``*.pt``) and an adapter's own files."""
    skip = {MANIFEST_NAME, ADAPTER_WEIGHTS, ADAPTER_CONFIG}
    return sorted(
        p for p in directory.iterdir() if p.is_file() and p.name not in skip and p.suffix != ".pt"
    )


def fingerprint(directory: str | os.PathLike) -> str:
    """The content hash of a model directory: sha256 over its files' names and sha256s
    (``base_files``). Reads every byte once."""
    directory = Path(directory)
    total = hashlib.sha256()
    for file in base_files(directory):
        total.update(f"{file.name}\0{hash_file(file)}\n".encode())
    return total.hexdigest()


def check_base(record: dict[str, Any], what: str) -> Path:
    """The base directory ``record`` names (``{"path", "sha256"}``), checked to hold the same
    bytes as when it was recorded; BaseChanged (naming the path) when it does not."""
    path = Path(record["path"])
    if not path.is_dir():
        raise BaseChanged(
            f"{what}: its LoRA base model {path} is gone; put the base back at that path (it "
            "was trained on it), or start a new run"
        )
    now = fingerprint(path)
    if now != record.get("sha256"):
        raise BaseChanged(
            f"{what}: its LoRA base model changed on disk: {path} (content sha256 "
            f"{str(record.get('sha256'))[:12]}... when recorded, {now[:12]}... now); the adapter "
            "was trained on the recorded base. Restore that base, or start a new run from this one"
        )
    return path


def base_record_of(checkpoint: Path) -> dict[str, Any] | None:
    """What a LoRA checkpoint's manifest records of its base, or None (an adapter export:
    its ``adapter_config.json`` names the base)."""
    try:
        record = json.loads((checkpoint / MANIFEST_NAME).read_text()).get(BASE_RECORD)
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) and record.get("path") else None


def adapter_base(checkpoint: Path, *, verify: bool = True) -> Path:
    """The directory of the base model an adapter directory belongs to: the manifest's record
    (its hash checked when ``verify``), else ``adapter_config.json``'s
    ``base_model_name_or_path``."""
    record = base_record_of(checkpoint)
    if record is not None:
        return check_base(record, str(checkpoint)) if verify else Path(record["path"])
    try:
        named = json.loads((checkpoint / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{checkpoint / ADAPTER_CONFIG}: unreadable ({exc})") from None
    if not named or not Path(named).is_dir():
        raise CheckpointError(
            f"{checkpoint}: its adapter names base model {named!r}, which is not a directory "
            "here; load it with PeftModel.from_pretrained(base, directory) on its base"
        )
    return Path(named)


# ---------------------------------------------------------------------------------------------
# the component


def adapter_config_dict(model: nn.Module) -> dict[str, Any]:
    """The active adapter's config as peft's ``save_pretrained`` writes it."""
    model = unwrap_model(model)
    config = model.peft_config[model.active_adapter]
    data = config.to_dict()
    for key, value in data.items():
        if isinstance(value, set):
            data[key] = sorted(value)
    data["inference_mode"] = True  # as peft saves it: a loaded adapter is not trained further
    return data


def named_base(config: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """An adapter config that names its base: the directory forge recorded (a model built in
    memory has no name of its own, and peft would write null)."""
    if not config.get("base_model_name_or_path") and base and base.get("path"):
        config = {**config, "base_model_name_or_path": str(base["path"])}
    return config


class AdapterWeights:
    """A peft model's adapter as the model-weights component of a checkpoint: only the
    adapter's tensors (and ``modules_to_save``), in peft's layout, never the frozen base.

    ``base``: what the manifest records of the base (``{"path", "sha256"}``).
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, base: dict | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.base = base

    def state_dict(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(unwrap_model(self.model))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_adapter_state(self.model, state, "the adapter state")

    def write(self, writer: Any, state: dict[str, torch.Tensor], stage_file: str | None) -> None:
        if stage_file is not None:
            raise CheckpointError("a LoRA adapter is saved whole, not per pipeline stage")
        if not writer.is_main:
            return
        model = unwrap_model(self.model)
        writer.set_meta(
            **{MODEL_RECORD: describe_model(model.get_base_model()), BASE_RECORD: self.base}
        )
        writer.save_safetensors(ADAPTER_WEIGHTS, state, metadata={"format": "pt"})
        writer.save_json(ADAPTER_CONFIG, named_base(adapter_config_dict(model), self.base))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(writer.path)

    def load_checkpoint(self, checkpoint: Path, manifest: Any) -> None:
        load_adapter_weights(self.model, checkpoint)


class StageAdapterWeights(AdapterWeights):
    """One pipeline stage's part of a peft model's adapter as the model-weights component: the
    stages' parts are gathered (``gather``: a collective every rank calls from
    ``state_dict``, giving the union of every rank's tensors) and rank 0 writes the whole
    adapter, the same files as a one-process LoRA checkpoint; a stage loads the tensors of its
    own layers from any LoRA checkpoint of the model."""

    def __init__(self, model: nn.Module, tokenizer: Any, base: dict | None, gather: Any) -> None:
        super().__init__(model, tokenizer, base)
        self.gather = gather

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.gather({k: v.detach().cpu() for k, v in super().state_dict().items()})

    def write(self, writer: Any, state: dict[str, torch.Tensor], stage_file: str | None) -> None:
        super().write(writer, state, None)  # rank 0 holds every stage's part

    def load_checkpoint(self, checkpoint: Path, manifest: Any) -> None:
        load_stage_adapter(self.model, checkpoint)


def load_stage_adapter(model: nn.Module, directory: Path) -> None:
    """Put the tensors of ``model``'s layers (one pipeline stage's part of a peft model) from a
    LoRA checkpoint's adapter into it, bit-exact; every adapter name of the stage must be
    there."""
    from peft import get_peft_model_state_dict

    own = set(get_peft_model_state_dict(unwrap_model(model)))
    state = read_adapter_state(Path(directory))
    load_adapter_state(model, {k: v for k, v in state.items() if k in own}, str(directory))


# ---------------------------------------------------------------------------------------------
# using a LoRA checkpoint


def load_adapter_model(
    checkpoint: Path, auto_class: Any = None, *, merge: bool = True, average: dict | None = None
) -> Any:
    """The model of an adapter directory: its base (built from the base directory's config and
    filled by forge's weights reader) with the adapter, merged into plain transformers weights
    when ``merge`` (no peft needed to use it), else as a ``PeftModel``. ``average``: the
    checkpoint's moving average of the adapter (by the trained model's parameter names), used
    in place of the adapter's weights."""
    from peft import PeftModel

    base_dir = adapter_base(checkpoint)
    base = load_pretrained(base_dir, auto_class or auto_class_of(base_dir))
    with no_hf_progress_bars(), quiet_peft():
        model = PeftModel.from_pretrained(base, checkpoint)
    if average is not None:
        put_adapter_average(model, average, checkpoint)
    model.eval()
    return model.merge_and_unload() if merge else model


def merge_adapter(base: nn.Module, checkpoint: Path, average: dict | None = None) -> nn.Module:
    """``base`` (any module, holding the base weights) with an adapter directory's adapter
    (or its moving ``average``) merged into its weights (``merge_and_unload``): the module
    itself, no peft wrapper, in eval mode. For a base that is no transformers model, built by
    its run's config."""
    from peft import PeftModel

    with no_hf_progress_bars(), quiet_peft():
        model = PeftModel.from_pretrained(base, checkpoint)
    if average is not None:
        put_adapter_average(model, average, checkpoint)
    return model.merge_and_unload().eval()


def put_adapter_average(model: nn.Module, average: dict[str, Any], checkpoint: Path) -> None:
    """The moving average of a LoRA run's trainable parameters in place of the loaded
    adapter's: the average is keyed by the names the trained ``PeftModel`` gave them, which a
    ``PeftModel`` loaded from the checkpoint has too."""
    import torch

    params = dict(model.named_parameters())
    unknown = [name for name in average if name not in params]
    if unknown:
        raise CheckpointError(
            f"{checkpoint}: its moving average of the weights covers parameters its adapter "
            f"does not have ({', '.join(unknown[:3])}); it was written for another model"
        )
    with torch.no_grad():
        for name, tensor in average.items():
            params[name].copy_(tensor.to(params[name].dtype))


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """peft reads a flag that transformers renamed: a warning that is not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        yield


def auto_class_of(directory: Path) -> Any:
    """The transformers class a model directory's ``config.json`` names (transformers' own
    classes only: custom code is never loaded)."""
    from forge.checkpoint.hf import CONFIG_NAME, architecture_class, read_config

    return architecture_class(read_config(Path(directory) / CONFIG_NAME))
