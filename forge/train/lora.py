"""LoRA fine-tuning with peft: the base model, the adapter step of the model-transform stage,
and the run's record of its frozen base.

``load_base_model(path)`` (a config's ``model``) builds the model to fine-tune from a forge
checkpoint, a ``forge export`` directory or any local Hugging Face model directory, and
``load_base_tokenizer(path)`` its tokenizer. A trainer given ``peft_config`` (a peft
``LoraConfig``) wraps the model with ``get_peft_model`` in its adapter step
(``apply_lora``): ``target_modules`` left empty are the architecture's attention and MLP
projections (``default_target_modules``), and a name that matches no module is an error
listing the names there are.

The frozen base is stored once per run (``record_base``): a base that is a model directory on
disk already (its ``name_or_path``) is referenced by path and content hash in
``run_NNN/base_model.json``; any other (built from a config, merged from another adapter) is
written to ``run_NNN/base_model/`` and referenced the same way. The hash is taken once when the
run starts and once when it resumes: a base that changed on disk is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from forge.checkpoint.adapter import (
    check_base,
    fingerprint,
    is_adapter_directory,
    load_adapter_model,
    quiet_peft,
)
from forge.checkpoint.io import CheckpointError
from forge.suggest import suggestion
from forge.text import short_list
from forge.train import dist
from forge.train.args import TrainingArgumentsError
from forge.wrappers import class_label, is_peft_model

logger = logging.getLogger(__name__)

BASE_RECORD_FILE = "base_model.json"
BASE_COPY_DIR = "base_model"
PEFT_KEY = "trainer.peft_config"


class LoraUsageError(Exception):
    """The base model given cannot be fine-tuned as asked (none given, not a transformers
    model's directory, quantisation without a GPU or bitsandbytes, another base than the run's):
    a usage error, exit 2 (the CLI maps it by class name, forge.error_kinds)."""


#: (family, attention projections, MLP projections): the names LoRA adapts by default. A model
#: is of the first family whose attention names it has all of (as leaf layers LoRA can adapt).
_FAMILIES = (
    (
        "Llama-style",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        ("gate_proj", "up_proj", "down_proj"),
    ),
    ("OPT-style", ("q_proj", "k_proj", "v_proj", "out_proj"), ("fc1", "fc2")),
    ("GPT-2-style", ("c_attn",), ("c_proj", "c_fc")),  # c_proj: attention output and MLP
    ("BERT-style", ("query", "key", "value"), ("dense",)),
    ("T5-style", ("q", "k", "v", "o"), ("wi", "wo", "wi_0", "wi_1")),
)


# ---------------------------------------------------------------------------------------------
# the base model


def _resolve_base(path: str | os.PathLike | None) -> Path:
    from forge.checkpoint.resolve import resolve_checkpoint

    if path is None or str(path) == "":
        raise LoraUsageError(
            "a LoRA config fine-tunes the model given with -D base_model=PATH (a forge "
            "checkpoint or run, a forge export, or a local Hugging Face model directory)"
        )
    # a model file's hash is taken once per run by record_base, not here
    try:
        return resolve_checkpoint(path, models=True, verify_hashes=False).path.resolve()
    except CheckpointError as exc:
        raise type(exc)(f"base_model: {exc}") from None


def load_base_model(
    path: str | os.PathLike | None,
    *,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
) -> nn.Module:
    """The model to fine-tune, from ``path``: a forge checkpoint (or run: its newest; a LoRA
    checkpoint gives its base with the adapter merged), a ``forge export`` directory or a local
    Hugging Face model directory. Its ``name_or_path`` is the directory it was read from (as
    ``from_pretrained`` sets it), which is how a run knows its base is on disk.

    ``load_in_4bit`` / ``load_in_8bit`` quantise the base with bitsandbytes (QLoRA), which
    needs a CUDA GPU: refused without one.
    """
    import torch

    from forge.checkpoint.adapter import auto_class_of
    from forge.checkpoint.weights import hf_directory_problem, load_pretrained

    directory = _resolve_base(path)
    quantized = _quantization(directory, load_in_4bit, load_in_8bit)
    if quantized and not torch.cuda.is_available():
        raise LoraUsageError(
            f"base_model {directory}: {quantized} quantises the base with bitsandbytes (QLoRA), "
            "which needs a CUDA GPU; this machine has none. Fine-tune the unquantised base "
            "(drop load_in_4bit / load_in_8bit), or run on a GPU"
        )
    if is_adapter_directory(directory):  # a LoRA checkpoint: its base with its adapter merged
        model = load_adapter_model(directory)
        model.name_or_path = model.config._name_or_path = ""  # not on disk as such
        return model
    problem = hf_directory_problem(directory)
    if problem is not None:
        raise LoraUsageError(
            f"base_model {directory} is not a Hugging Face model directory ({problem}): "
            "base_model reads a transformers model (a checkpoint of one, or its forge export). "
            "To fine-tune a module of your own, keep the config's own model block (the module, "
            "built as your training builds it) and add only the adapter to its trainer block "
            "(== lora.peft_config(), or a peft_config: of your own with its target_modules); "
            "see docs/trainers.md, 'LoRA on a module of your own'"
        )
    if quantized:
        model = _load_quantized(directory, load_in_4bit)
    else:
        model = load_pretrained(directory, auto_class_of(directory))
    model.name_or_path = model.config._name_or_path = str(directory)
    return model


def base_skeleton(path: str | os.PathLike | None) -> nn.Module:
    """The base model's structure on the meta device, from its config alone (no weights read):
    what the config check looks at for the LoRA target modules."""
    import torch

    from forge.checkpoint.adapter import adapter_base, auto_class_of
    from forge.checkpoint.hf import CONFIG_NAME, read_config

    directory = _resolve_base(path)
    if is_adapter_directory(directory):
        directory = adapter_base(directory, verify=False)
    with torch.device("meta"):
        return auto_class_of(directory)._from_config(read_config(directory / CONFIG_NAME))


def load_base_tokenizer(path: str | os.PathLike | None) -> Any:
    """The tokenizer saved with the base model (its directory's tokenizer files)."""
    from forge.checkpoint.weights import checkpoint_tokenizer

    return checkpoint_tokenizer(_resolve_base(path))


def _quantization(directory: Path, load_in_4bit: bool, load_in_8bit: bool) -> str | None:
    """What quantises the base, if anything: an argument, or the base's own config."""
    if load_in_4bit or load_in_8bit:
        return "load_in_4bit" if load_in_4bit else "load_in_8bit"
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = config.get("quantization_config") if isinstance(config, dict) else None
    if found:
        return f"its config's quantization_config ({found.get('quant_method', 'quantized')})"
    return None


def _load_quantized(directory: Path, four_bit: bool) -> nn.Module:  # pragma: no cover - GPU only
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise LoraUsageError(
            "load_in_4bit / load_in_8bit need the bitsandbytes package; pip install bitsandbytes"
        )
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from forge.checkpoint.adapter import auto_class_of

    quant = BitsAndBytesConfig(load_in_4bit=four_bit, load_in_8bit=not four_bit)
    model = auto_class_of(directory).from_pretrained(directory, quantization_config=quant)
    return prepare_model_for_kbit_training(model)


# ---------------------------------------------------------------------------------------------
# the adapter step


def adaptable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's leaf layers LoRA can adapt (linear, embedding, convolution), by name."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return {
        name: module
        for name, module in model.named_modules()
        if name and (isinstance(module, kinds) or type(module).__name__ == "Conv1D")
    }


def known_target_modules(model: nn.Module) -> list[str] | None:
    """The attention and MLP projections of a Llama-, OPT-, GPT-2-, BERT- or T5-style model,
    or None for a model of no style forge knows."""
    present = {name.rpartition(".")[2] for name in adaptable_layers(model)}
    for _, attention, mlp in _FAMILIES:
        if set(attention) <= present:
            return [name for name in (*attention, *mlp) if name in present]
    return None


def default_target_modules(model: nn.Module) -> list[str]:
    """The attention and MLP projections of a Llama-, OPT-, GPT-2-, BERT- or T5-style model;
    TrainingArgumentsError naming the layers there are for any other. (Where the config sets
    the LoRA config, forge train's check says how to name them there: forge.launch.preflight.)"""
    found = known_target_modules(model)
    if found is not None:
        return found
    raise TrainingArgumentsError(
        [
            f"{PEFT_KEY}.target_modules: {unknown_targets(model)}; name them in the LoRA "
            f"config's target_modules, e.g. target_modules: {example_targets(model)} (a config "
            "that takes its peft_config from the template library's trainers/lora.yaml sets "
            "them with -D lora_target_modules='[...]')"
        ]
    )


def unknown_targets(model: nn.Module) -> str:
    """Why ``model``'s LoRA targets must be named, and the names of the layers there are."""
    return (
        f"forge cannot tell which layers of a {class_label(model)} to adapt (it knows Llama-, "
        "OPT-, GPT-2-, BERT- and T5-style attention and MLP projections); the layers LoRA can "
        f"adapt are named {_layer_names(model)}"
    )


def example_targets(model: nn.Module) -> str:
    """``[a, b]``: a flow list of (up to two of) ``model``'s adaptable layer names."""
    names = sorted({n.rpartition(".")[2] for n in adaptable_layers(model)})
    return f"[{', '.join(names[:2])}]"


def target_problems(model: nn.Module, targets: Any, field: str = "target_modules") -> list[str]:
    """A message for each ``target_modules`` (or ``field``) entry that matches no layer of ``model`` (peft
    matches a name to a module whose name is it or ends with ``.name``; a single string is a
    regular expression matched against whole module names)."""
    names = [name for name, _ in model.named_modules() if name]
    if isinstance(targets, str):
        if any(re.fullmatch(targets, name) for name in names):
            return []
        return [
            f"{PEFT_KEY}.{field}: the pattern {targets!r} matches no module name of "
            f"{class_label(model)} (e.g. {short_list(names[:5])}); its layers LoRA adapts are "
            f"named {_layer_names(model)}"
        ]
    leaves = {name.rpartition(".")[2] for name in names}
    problems = []
    for target in targets or ():
        if any(name == target or name.endswith(f".{target}") for name in names):
            continue
        hint = suggestion(target, leaves) or "."
        problems.append(
            f"{PEFT_KEY}.{field}: {class_label(model)} has no module named {target!r}{hint} "
            f"Its layers LoRA adapts are named {_layer_names(model)}"
        )
    return problems


def _layer_names(model: nn.Module) -> str:
    return short_list(sorted({n.rpartition(".")[2] for n in adaptable_layers(model)}), 30)


def lora_config_for(model: nn.Module, config: Any) -> Any:
    """``config`` (a peft config) with ``target_modules`` filled from the architecture when
    empty, checked against ``model``'s layers."""
    from peft import PeftConfig

    if not isinstance(config, PeftConfig):
        raise TypeError(
            f"{PEFT_KEY} must be a peft config such as peft:LoraConfig (got "
            f"{type(config).__name__})"
        )
    saved = list(getattr(config, "modules_to_save", None) or ())
    if not hasattr(config, "target_modules"):  # another kind of adapter: peft checks it
        problems = target_problems(model, saved, "modules_to_save")
        if problems:
            raise TrainingArgumentsError(problems)
        return config
    targets = config.target_modules or default_target_modules(model)
    problems = target_problems(model, sorted(targets) if isinstance(targets, set) else targets)
    problems += target_problems(model, saved, "modules_to_save")
    if problems:
        raise TrainingArgumentsError(problems)
    # GPT-2's Conv1D keeps its weight transposed: peft must know, as for GPT-2's own config
    transposed = any(
        type(module).__name__ == "Conv1D" and _targeted(name, targets)
        for name, module in adaptable_layers(model).items()
    )
    if transposed and hasattr(config, "fan_in_fan_out"):
        return dataclasses.replace(config, target_modules=targets, fan_in_fan_out=True)
    return dataclasses.replace(config, target_modules=targets)


def _targeted(name: str, targets: Any) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def apply_lora(model: nn.Module, config: Any) -> nn.Module:
    """The adapter step: ``model`` wrapped by peft's ``get_peft_model`` (its base frozen)."""
    from peft import get_peft_model

    config = lora_config_for(model, config)
    with quiet_peft():
        peft_model = get_peft_model(model, config)
    trainable, total = peft_model.get_nb_trainable_parameters()
    logger.debug("LoRA: %d of %d parameters trainable", trainable, total)
    return peft_model


def split_problems(model: nn.Module, config: Any, held: list[set[str]]) -> list[str]:
    """Why LoRA ``config`` cannot train ``model`` split into pipeline stages, of which stage
    ``k`` holds the modules ``held[k]`` (and those inside them): a module it adapts (or keeps
    whole: ``modules_to_save``) that two stages hold, each of which would train an adapter of
    its own (an embedding tied to the output head), or a stage holding none of the modules it
    adapts. Bad target names raise TrainingArgumentsError (``lora_config_for``)."""
    config = lora_config_for(model, config)
    targets = getattr(config, "target_modules", None)
    saved = list(getattr(config, "modules_to_save", None) or ())
    names = [name for name, _ in model.named_modules() if name]
    adapted = [n for n in names if targets is not None and _targeted(n, targets)]
    kept_whole = [n for n in names if _targeted(n, saved)]

    def holders(name: str) -> list[int]:
        return [k for k, kept in enumerate(held) if any(_inside(name, m) for m in kept)]

    problems = []
    for name in [*adapted, *kept_whole]:
        stages = holders(name)
        if len(stages) > 1:
            field = "target_modules" if name in adapted else "modules_to_save"
            problems.append(
                f"{PEFT_KEY}.{field}: {name!r} is held by pipeline stages "
                f"{' and '.join(map(str, stages))} (a tensor tied across them, such as an input "
                "embedding tied to the output head), and each stage would train an adapter of "
                f"its own for it; leave {name!r} out of {field}, untie it "
                "(tie_word_embeddings: false), or train with the plain trainer"
            )
    idle = [k for k in range(len(held)) if adapted and not any(k in holders(n) for n in adapted)]
    if idle:
        problems.append(
            f"{PEFT_KEY}.target_modules: pipeline stage(s) {short_list(map(str, idle))} hold none of the "
            f"modules LoRA adapts ({short_list(map(repr, adapted[:4]))}), and a stage trains only its own "
            "layers' adapter; adapt a layer every stage holds (the attention and MLP "
            "projections, target_modules left empty), or split the model otherwise"
        )
    return problems


def _inside(name: str, module: str) -> bool:
    return name == module or name.startswith(f"{module}.")


class LoraStep:
    """The adapter step of the model-transform stage for a trainer given ``peft_config``: the
    model wrapped by peft (its base frozen); in training, first the run's record of its frozen
    base (``base``, which every checkpoint's adapter component carries)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.base: dict[str, Any] | None = None

    def apply(self, model: nn.Module, *, record_in: Any = None, topology: Any = None) -> nn.Module:
        """``model`` wrapped by peft; with ``record_in`` (the run directory) rank 0 records (or,
        resuming, checks) the run's base first, and every rank gets the record or the refusal."""
        config = lora_config_for(model, self.config)  # bad targets: refused before any write
        if record_in is not None:
            self.base = self._record(model, record_in, topology)
        return apply_lora(model, config)

    @staticmethod
    def applied_to(model: nn.Module) -> bool:
        """Whether ``model`` is wrapped by peft already (its checkpoints hold the adapter)."""
        return is_peft_model(model)

    @staticmethod
    def _record(model: nn.Module, run_dir: Any, topology: Any) -> dict[str, Any]:
        record, error = None, None
        if topology is None or topology.is_main:
            try:
                record = record_base(model, run_dir)
            except (CheckpointError, LoraUsageError) as exc:
                error = exc
        record, error = dist.broadcast_object((record, error))
        if error is not None:
            raise error
        return record


# ---------------------------------------------------------------------------------------------
# the run's base


def base_on_disk(model: nn.Module) -> Path | None:
    """The model directory ``model`` was read from (its ``name_or_path``), or None when it is
    not one on disk (built from a config, merged in memory)."""
    from forge.checkpoint.weights import hf_directory_problem

    name = getattr(model, "name_or_path", None) or ""
    path = Path(name) if name else None
    if path is None or not path.is_dir() or hf_directory_problem(path) is not None:
        return None
    return path.resolve()


def record_base(model: nn.Module, run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's record of its frozen base (``{"path", "sha256", "copied"}``), made once per
    run (on rank 0): a base on disk is referenced, any other written to ``base_model/``.
    A run that has a record already (a resume) checks the base still has its hash."""
    from forge.checkpoint.io import write_json_atomic

    run_dir = Path(run_dir)
    record_file = run_dir / BASE_RECORD_FILE
    source = base_on_disk(model)
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        if source is not None and not record.get("copied") and Path(record["path"]) != source:
            raise LoraUsageError(
                f"run {run_dir} fine-tunes the base model {record['path']}, and this job loaded "
                f"{source}; resume with the run's own base, or start a new run"
            )
        check_base(record, f"cannot resume run {run_dir}")
        return record
    run_dir.mkdir(parents=True, exist_ok=True)
    if source is None:
        source = _write_base(model, run_dir / BASE_COPY_DIR)
        copied = True
    else:
        copied = False
    record = {"path": str(source), "sha256": fingerprint(source), "copied": copied}
    write_json_atomic(record_file, record)
    logger.info(
        "LoRA base %s %s (%s)",
        "written to" if copied else "referenced at",
        source,
        f"sha256 {record['sha256'][:12]}...",
    )
    return record


def _write_base(model: nn.Module, target: Path) -> Path:
    """Write the frozen base as a Hugging Face directory, in place only when complete."""
    from forge.checkpoint.io import save_model_weights

    staging = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_model_weights(model, staging)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target.resolve()
