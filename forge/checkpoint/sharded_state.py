"""Checkpoint components of state sharded across data-parallel ranks (scope ``sharded``):
an FSDP2 model's weights and its optimizer's moments, each rank saving its own rows
(forge/checkpoint/sharded.py reads and writes the rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from forge.checkpoint.hf import MODEL_RECORD, describe_model
from forge.checkpoint.io import CheckpointError
from forge.checkpoint.layout import SHARDS_METADATA
from forge.checkpoint.sharded import load_sharded_weights, local_piece, split_state
from forge.checkpoint.state import ModelWeights


class ShardedWeights:
    """A sharded model's weights as a checkpoint component (scope ``sharded``): every rank
    writes its rows of each parameter, rank 0 also the tensors that are whole on every rank
    (buffers). Loads from any checkpoint of the model, sharded or not."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed as dist

        main = not dist.is_initialized() or dist.get_rank() == 0
        return split_state(self.model.state_dict(), keep_whole=main)

    def load_state_dict(self, state: dict[str, Any]) -> None:  # loads through load_checkpoint
        raise NotImplementedError("sharded weights load from a checkpoint directory")

    def write(self, writer: Any, state: dict[str, Any], stage_file: str | None) -> None:
        if writer.is_main:  # the config (forge export builds the directory from it), tokenizer
            writer.set_meta(**{MODEL_RECORD: describe_model(self.model)})
            ModelWeights(self.model, self.tokenizer).write_extras(writer)
        layout = json.dumps(state["layout"])
        writer.save_safetensors(stage_file, state["tensors"], metadata={SHARDS_METADATA: layout})

    def load_checkpoint(self, checkpoint: Path, manifest: Any) -> None:
        load_sharded_weights(self.model, checkpoint, strict=True)


class ShardedOptimizerState:
    """An optimizer over DTensor parameters, keyed by parameter name like ``OptimizerState``;
    each rank saves its rows of the moments. Loads the whole state (merged from the shards
    of any number of ranks, or a plain checkpoint's) and keeps its own rows."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        if not self.optimizer.state:
            return {}  # no step yet (see OptimizerState)
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        flat = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return split_state(flat, keep_whole=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the whole state (keyed by parameter name, as ``OptimizerState`` saves it):
        each DTensor parameter's moments keep this rank's rows."""
        from torch.distributed.tensor import DTensor

        if not state:
            return
        names = {id(p): name for name, p in self.model.named_parameters()}
        found, groups, index = {}, [], 0
        for group in self.optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            ids = []
            for param in group["params"]:
                name = names[id(param)]
                for key in settings:
                    settings[key] = state.get(f"param_groups.{name}.{key}", settings[key])
                prefix = f"state.{name}."
                own = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
                for key, value in own.items():
                    if isinstance(param, DTensor) and value.dim() and value.shape == param.shape:
                        local, offset, _ = local_piece(param)
                        rows = value[offset : offset + local.shape[0]].to(local.dtype)
                        own[key] = DTensor.from_local(
                            rows.contiguous(),
                            param.device_mesh,
                            param.placements,
                            shape=param.shape,
                            stride=param.stride(),
                        )
                if own:
                    found[index] = own
                ids.append(index)
                index += 1
            groups.append({**settings, "params": ids})
        if not found:
            raise CheckpointError(
                "the saved optimizer state names none of this model's parameters (saved e.g. "
                f"{sorted(state)[:3]})"
            )
        self.optimizer.load_state_dict({"state": found, "param_groups": groups})
