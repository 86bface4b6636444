"""One object for the read side: a checkpoint or run forge wrote, and what a caller asks of it.

``CheckpointReader(path)`` opens a checkpoint directory, a run directory (its newest valid
checkpoint, or with ``best`` the one ``run.json`` records as best), a project (its newest run)
or a Hugging Face model directory, validated once by forge.checkpoint.resolve. It hands out
the config the run trained with, the metrics stored with the checkpoint, its state dict, its
tokenizer, and the model with its weights: built as the run's training built it (the
``trainer.model`` of the run's ``config.yaml``), filled by forge's one weights reader, so the
model's logits are bit for bit those ``forge evaluate`` computes from the same checkpoint.

Every layout loads alike: one ``model.safetensors``, shards, one file per pipeline stage, the
per-rank shards of an FSDP run (put back whole), written by any process count. A LoRA
checkpoint holds only the adapter: its model is the base recorded in its manifest (its hash
checked) with the adapter, as a peft model or merged into the base's weights
(``merge_lora``). ``ema`` puts the moving average of the weights the checkpoint holds
(``ema_decay``) in place of the trained weights it covers.

What the reading commands do is asked of it too: ``export``, ``evaluate``, ``predict`` and
``generate`` (forge.read.export, .predict, .generate beside it, each given the reader); forge/cli
parses, prints and picks exit codes around them. Its ``run`` (forge.read.run.RunReader) reads
the run that wrote it: its record and config, and what ``forge runs`` and ``forge checkpoints``
list.

It lives above forge.checkpoint (which reads files and knows no config or trainer) because
building a run's model needs the run's config (forge.config), the run's record (forge.runs)
and the moving average's and LoRA's readers (forge.train).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge.checkpoint.adapter import adapter_base, is_adapter_directory
from forge.checkpoint.io import ADAPTER_WEIGHTS
from forge.checkpoint.resolve import Checkpoint, CheckpointUsageError, resolve_checkpoint
from forge.runs import PROJECT_RUNS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from forge.config import Config, Project
    from forge.read.run import RunReader

logger = logging.getLogger(__name__)

__all__ = ["CheckpointReader", "export_model"]


class CheckpointReader:
    """A checkpoint (or a run's, or a project's newest run's) opened for reading.

    ``path``: a checkpoint, run, ``checkpoints/`` or project directory, or a Hugging Face
    model or adapter directory; ``best``: the run's best checkpoint; ``allow``: more module
    roots the run's config may call (as ``--allow``); ``models=False`` refuses a model directory
    outside any run (what only a run can give: ``evaluate``). The checkpoint's manifest, sizes and
    hashes are checked here, once; ``CheckpointNotFound`` says what is wrong with ``path``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        best: bool = False,
        allow: list[str] = (),
        models: bool = True,
    ) -> None:
        self.asked = Path(path)
        self.checkpoint: Checkpoint = resolve_checkpoint(
            path, best=best, models=models, runs=PROJECT_RUNS
        )
        self.path: Path = self.checkpoint.path  # the checkpoint directory read
        self.allow = list(allow)

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r})"

    # ------------------------------------------------------------------ what it is
    @property
    def step(self) -> int | None:
        """The optimizer step the checkpoint was saved at (None for a model directory)."""
        return self.checkpoint.step

    @property
    def metrics(self) -> dict[str, Any]:
        """The evaluation metrics saved with the checkpoint (empty when it has none)."""
        manifest = self.checkpoint.manifest
        return dict(manifest.metrics) if manifest is not None else {}

    @property
    def is_adapter(self) -> bool:
        """Whether the checkpoint holds a LoRA adapter (its base is stored once per run)."""
        return is_adapter_directory(self.path)

    @property
    def has_ema(self) -> bool:
        """Whether the checkpoint holds a moving average of the weights (``ema_decay``)."""
        from forge.train.ema import EMA_COMPONENT

        manifest = self.checkpoint.manifest
        return manifest is not None and bool((manifest.components or {}).get(EMA_COMPONENT))

    @functools.cached_property
    def run(self) -> RunReader | None:
        """The run that wrote the checkpoint (``RUN/checkpoints/checkpoint-N``) opened for
        reading (forge.read.run), or None outside a run."""
        from forge.read.run import RunReader

        run_dir = self.path.resolve().parent.parent
        if (run_dir / "run.json").is_file() and (run_dir / "config.yaml").is_file():
            return RunReader(run_dir, allow=self.allow)
        return None

    @property
    def run_dir(self) -> Path | None:
        """The run's directory, or None."""
        return self.run.run_dir if self.run is not None else None

    @property
    def record(self) -> dict[str, Any]:
        """The run's ``run.json`` (empty outside a run)."""
        return self.run.record if self.run is not None else {}

    @property
    def project(self) -> Project | None:
        """The project the run belongs to (None outside a run)."""
        return self.run.project if self.run is not None else None

    @property
    def config(self) -> Config | None:
        """The config the run trained with (its ``config.yaml``, parsed and checked: a
        ``ConfigError`` lists every problem), or None outside a run. ``config.text`` is the
        YAML, ``config.build(target)`` builds its objects."""
        return self.run.config if self.run is not None else None

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer (or, for a model of images or sound, the processor) saved with the
        checkpoint, or None when it holds none."""
        from forge.checkpoint.io import no_hf_progress_bars

        path = self.path
        with no_hf_progress_bars():
            if (path / "preprocessor_config.json").is_file():
                from transformers import AutoProcessor

                return AutoProcessor.from_pretrained(path)
            if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(path)
        return None

    # ------------------------------------------------------------------ weights
    def state_dict(self, *, ema: bool = False, merge_lora: bool = False) -> dict[str, torch.Tensor]:
        """The checkpoint's weights by name, on the CPU: every name of the model's
        ``state_dict()`` (tied names each), so ``model.load_state_dict(..., strict=True)``
        takes them. ``ema``: the moving average in place of the weights it covers, each in
        the saved dtype. A LoRA checkpoint gives its adapter (peft's names), or with
        ``merge_lora`` the base's state dict with the adapter merged in."""
        self._check_options(ema=ema, merge_lora=merge_lora)
        if self.is_adapter:
            if merge_lora:
                return self.model(ema=ema, merge_lora=True).state_dict()
            if ema:
                from peft import get_peft_model_state_dict

                return get_peft_model_state_dict(self.model(ema=True))
            from safetensors.torch import load_file

            return load_file(self.path / ADAPTER_WEIGHTS)
        from forge.checkpoint.weights import read_state_dict

        tensors = read_state_dict(self.path)
        if ema:
            from forge.train.ema import with_ema_weights

            tensors = with_ema_weights(tensors, self._average())
        return tensors

    def model(
        self,
        *,
        ema: bool = False,
        merge_lora: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> nn.Module:
        """The model with the checkpoint's weights, in eval mode, on ``device`` (default: the
        CPU) in ``dtype`` (default: as built).

        A run's model is built as its training built it (the module, or what its builder
        returns), so its forward gives what ``forge evaluate`` computes; a model directory
        outside a run is built from its ``config.json``. A LoRA checkpoint's model is a peft
        model around its base, or with ``merge_lora`` the base module with the adapter merged
        in (no peft needed to use it). ``ema``: the moving average of the weights in place of
        the trained ones."""
        self._check_options(ema=ema, merge_lora=merge_lora)
        average = self._average() if ema else None  # refused before anything is built
        model = self._built_with_weights(trainable=ema)
        if average is not None:
            from forge.train.ema import load_ema_weights

            load_ema_weights(model, average, str(self.path))
        if merge_lora:
            model = model.merge_and_unload()
        if device is not None or dtype is not None:
            model.to(device=device, dtype=_dtype(dtype))
        return model.eval()

    # ------------------------------------------------------------------ what commands do
    def export(self, output: str | os.PathLike, **options: Any) -> Path:
        """Write the checkpoint's model to ``output`` (``forge export``): a Hugging Face model
        directory, a LoRA adapter (or with ``merge_lora`` its base with the adapter merged in),
        or a plain module's state dict; returns the checkpoint exported.
        forge.read.export.export_checkpoint documents ``options`` (``force``,
        ``max_shard_size``, ``submodule``, ``ema``, ``merge_lora``)."""
        from forge.read.export import export_checkpoint

        return export_checkpoint(self, output, **options)

    def evaluate(self, split: str = "eval", *, ema: bool = False) -> dict[str, float]:
        """The metrics of the checkpoint on its run's ``split``, as its run's trainer computes
        them (forge.read.predict.evaluate_checkpoint)."""
        from forge.read.predict import evaluate_checkpoint

        return evaluate_checkpoint(self, split, ema=ema)

    def predict(self, inputs: str | os.PathLike, output: str | os.PathLike, **options: Any) -> int:
        """One JSON line of prediction per line of ``inputs``, written to ``output``; returns
        how many (forge.read.predict.predict_file documents ``options``)."""
        from forge.read.predict import predict_file

        return predict_file(self, Path(inputs), Path(output), **options)

    def generate(self, prompt: str, **options: Any) -> list[str]:
        """Texts sampled for ``prompt`` from the checkpoint's model and tokenizer
        (forge.read.generate.generate_text documents ``options``)."""
        from forge.read.generate import generate_text

        return generate_text(self, prompt, **options)

    # ------------------------------------------------------------------ helpers
    def _check_options(self, *, ema: bool, merge_lora: bool) -> None:
        if merge_lora and not self.is_adapter:
            raise CheckpointUsageError(
                f"merge_lora merges a LoRA adapter into its base, and {self.path} holds no "
                "adapter (it is a full model); leave out merge_lora"
            )
        if ema and not self.has_ema:
            raise CheckpointUsageError(
                f"ema: {self.path} holds no moving average of the weights (it was not trained "
                "with trainer.args.ema_decay set); leave out ema to use its weights"
            )

    def _average(self) -> dict[str, torch.Tensor]:
        from forge.train.ema import read_ema_state

        return read_ema_state(self.path)

    def _built_with_weights(self, *, trainable: bool) -> nn.Module:
        """The model holding the checkpoint's weights (a LoRA checkpoint's: a peft model whose
        adapter is ``trainable``, as in training, for the moving average to load into)."""
        from forge.checkpoint.weights import load_model_weights

        adapter = self.is_adapter
        if self.run_dir is None:
            return self._model_directory(trainable)
        model = self._run_model()
        # a LoRA run's base: the directory its manifest records, its hash checked
        load_model_weights(model, adapter_base(self.path) if adapter else self.path, strict=True)
        if not adapter:
            return model
        from peft import PeftModel

        from forge.checkpoint.adapter import quiet_peft
        from forge.checkpoint.io import no_hf_progress_bars

        with no_hf_progress_bars(), quiet_peft():
            return PeftModel.from_pretrained(model, self.path, is_trainable=trainable)

    def _model_directory(self, trainable: bool) -> nn.Module:
        """A Hugging Face model (or adapter) directory outside any run, built from its
        ``config.json``."""
        from forge.checkpoint.adapter import auto_class_of, load_adapter_model
        from forge.checkpoint.weights import hf_directory_problem, load_pretrained

        if self.is_adapter:
            return load_adapter_model(self.path, merge=False)
        problem = hf_directory_problem(self.path)
        if problem is not None:
            raise CheckpointUsageError(
                f"{self.path} is not a Hugging Face model directory ({problem}) and is not "
                "inside a forge run whose config.yaml builds its model; give the run's "
                "checkpoint"
            )
        return load_pretrained(self.path, auto_class_of(self.path))

    def _run_model(self) -> nn.Module:
        """The run's model as its training built it, before any weights are loaded."""
        from forge.read.run_model import build_run_model

        return build_run_model(self.run_dir, self.config, self.project, self.record)


def export_model(checkpoint: str | os.PathLike, output: str | os.PathLike, **options: Any) -> Path:
    """``forge export`` in one call: ``CheckpointReader(checkpoint).export(output, **options)``
    (its ``export`` documents ``options``). ``checkpoint`` is a checkpoint, a run directory (its
    newest valid checkpoint), a project, or a Hugging Face model directory."""
    return CheckpointReader(checkpoint).export(output, **options)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` as a torch dtype."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is no torch dtype (e.g. 'float32', 'bfloat16')")
    return found
