"""One checkpoint layer for every trainer: atomic, validated, and unable to run code.

A checkpoint is a directory written under a temporary name and renamed into place once
complete, with ``manifest.json`` (sizes and sha256 of every file, the job's topology and the
components with their scopes) written last. ``registry`` says what a trainer's checkpoints
hold and who writes each file; ``layout`` names, discovers, validates and rotates them (and
imports torch only to read state-file headers when hashes are verified, so ``forge
checkpoints`` starts fast); ``writer`` commits them atomically; ``resolve`` turns what a user
types (a checkpoint, a run, ``--best``, a project) into a checkpoint validated once;
``weights`` is the one reader of model weights; ``hf`` knows which weight names a transformers
architecture has, so a ``config.json`` stands only beside weights it describes; ``components``
holds the components every trainer saves (weights, optimizer, random generators);
``manager`` is what a training loop calls to save, finish and restore checkpoints.

Names are imported lazily: ``import forge.checkpoint.layout`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "io",
    "load_torch_state": "io",
    "load_model_weights": "weights",
    "read_weights": "weights",
    "weight_files": "weights",
    "unwrap_model": "wrappers",
    "FORMAT_VERSION": "layout",
    "MANIFEST_NAME": "layout",
    "CheckpointInfo": "layout",
    "CheckpointManifest": "layout",
    "checkpoint_name": "layout",
    "component_file_names": "layout",
    "find_checkpoints": "layout",
    "find_latest_checkpoint": "layout",
    "find_leftovers": "layout",
    "inspect_checkpoint": "layout",
    "latest_valid_checkpoint": "layout",
    "Checkpoint": "resolve",
    "CheckpointNotFound": "resolve",
    "resolve_checkpoint": "resolve",
    "resume_checkpoint": "resolve",
    "parse_checkpoint_step": "layout",
    "read_manifest": "layout",
    "rotate_checkpoints": "layout",
    "stage_weights_name": "layout",
    "validate_checkpoint": "layout",
    "CheckpointRegistry": "registry",
    "CheckpointSnapshot": "registry",
    "Component": "registry",
    "Scope": "registry",
    "Stateful": "registry",
    "ModelWeights": "components",
    "OptimizerState": "components",
    "RngState": "components",
    "capture_rng_state": "components",
    "restore_rng_state": "components",
    "CheckpointWriter": "writer",
    "CheckpointManager": "manager",
    "model_component": "components",
    "optimizer_component": "components",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'forge.checkpoint' has no attribute {name!r}")
    package = "forge" if module == "wrappers" else "forge.checkpoint"
    value = getattr(importlib.import_module(f"{package}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
