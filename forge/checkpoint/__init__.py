"""One checkpoint layer for every trainer: atomic, validated, and unable to run code.

A checkpoint is a directory written under a temporary name and renamed into place once
complete, with ``manifest.json`` (sizes and sha256 of every file) written last.
"""

from forge.checkpoint.io import CheckpointError, load_model_weights, unwrap_model
from forge.checkpoint.layout import (
    MANIFEST_NAME,
    TRAINING_STATE_NAME,
    CheckpointInfo,
    CheckpointManifest,
    checkpoint_name,
    find_checkpoints,
    find_latest_checkpoint,
    parse_checkpoint_step,
    rank_state_name,
    read_manifest,
    rotate_checkpoints,
    stage_weights_name,
    validate_checkpoint,
)
from forge.checkpoint.state import capture_rng_state, load_torch_state, restore_rng_state
from forge.checkpoint.writer import CheckpointWriter

__all__ = [
    "MANIFEST_NAME",
    "TRAINING_STATE_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManifest",
    "CheckpointWriter",
    "capture_rng_state",
    "checkpoint_name",
    "find_checkpoints",
    "find_latest_checkpoint",
    "load_model_weights",
    "load_torch_state",
    "parse_checkpoint_step",
    "rank_state_name",
    "read_manifest",
    "restore_rng_state",
    "rotate_checkpoints",
    "stage_weights_name",
    "unwrap_model",
    "validate_checkpoint",
]
