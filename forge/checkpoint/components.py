"""The checkpoint components every trainer uses: the model's weights (whole, one pipeline
stage's, or each rank's rows under FSDP2), the optimizer's state keyed by parameter name (whole
or sharded), the random generators; and ``model_component`` / ``optimizer_component``, which
choose among them (a peft model's weights are its adapter: forge/checkpoint/adapter.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forge.checkpoint.hf import MODEL_RECORD, describe_model, is_hf_model, prepare_config
from forge.checkpoint.io import CheckpointError
from forge.checkpoint.layout import SHARDS_METADATA
from forge.checkpoint.registry import Component, Scope
from forge.checkpoint.sharded import (
    load_sharded_weights,
    local_piece,
    split_state,
    tied_aliases,
    without_tied_copies,
)
from forge.checkpoint.weights import load_model_weights
from forge.wrappers import is_peft_model, unwrap_model


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The state of every random generator a training step draws from.

    Python ``random``, numpy's global generator, torch CPU and the CUDA generator of ``device``
    (the trainer's; by default the current device, when CUDA is in use), encoded as tensors and
    plain data so ``torch.load(weights_only=True)`` reads it.
    """
    version, internal, gauss_next = random.getstate()
    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        # Only one device: touching every device would create a CUDA context on each GPU
        # from every rank.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put every generator back to a state from ``capture_rng_state``."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["algorithm"],
            np.asarray(npy["keys"].numpy(), dtype=np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], device)
        else:
            torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------
# components


class RngState:
    """Every random generator of this rank (a rank-scoped component, restored last)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state, self.device)


def is_main_rank() -> bool:
    """Whether this process is rank 0 of its job (or runs alone)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _keeps_whole(given: bool | None) -> bool:
    """Whether this rank writes a sharded component's whole tensors: as ``given``, else rank 0."""
    return is_main_rank() if given is None else given


def _plain_name(name: str) -> str:
    """A parameter name without DDP's ``module.`` or torch.compile's ``_orig_mod.`` parts."""
    return ".".join(p for p in name.split(".") if p not in ("module", "_orig_mod"))


def param_groups_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The settings of each parameter's group (``param_groups.<fqn>.lr``...), as the flattened
    optimizer state dict keys them, for an optimizer that holds no state."""
    names = {id(p): _plain_name(n) for n, p in model.named_parameters()}
    flat: dict[str, Any] = {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            flat.update({f"param_groups.{names[id(param)]}.{k}": v for k, v in settings.items()})
    return flat


def load_param_groups_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Set each group's settings from ``param_groups_by_name``'s keys (the first of its
    parameters that has them); a group none of whose parameters are named keeps its own.
    Fails when the saved settings name none of the parameters."""
    names = {id(p): _plain_name(n) for n, p in model.named_parameters()}
    found = False
    for group in optimizer.param_groups:
        for param in group["params"]:
            prefix = f"param_groups.{names[id(param)]}."
            saved = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            if saved:
                group.update({k: v for k, v in saved.items() if k != "params"})
                found = True
                break
    if state and not found:
        raise CheckpointError(
            "the saved optimizer settings name none of this model's parameters (saved e.g. "
            f"{sorted(state)[:3]}, this model has e.g. {sorted(names.values())[:3]})"
        )


class OptimizerState:
    """An optimizer's state keyed by parameter name (``state.<fqn>.exp_avg``), not by index.

    Uses torch.distributed.checkpoint's flattened optimizer state dict, so a pipeline stage
    can never load another stage's moments (same shapes, other parameters), and a checkpoint
    of one split loads into another: each optimizer takes the names of its own parameters.
    ``model`` is what the optimizer's parameters belong to (wrapped by DDP / FSDP or not).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    @staticmethod
    def _options() -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not self.optimizer.state:
            # no state (no step taken yet, or an optimizer that keeps none: SGD without
            # momentum): the library would initialise the state with a zero step, which
            # changes the first real step's bias correction; the groups' settings (the
            # learning rate the schedule set) are saved all the same
            return param_groups_by_name(self.model, self.optimizer)
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not any(k.startswith("state.") for k in state):
            load_param_groups_by_name(self.model, self.optimizer, state)
            return
        # one naming rule for both sides: a model that keeps its layers as ``self.module``
        # (LossAdapter, a user's wrapper) is saved under ``module.*``, which the rule removes
        own = {_plain_name(n) for n, p in self.model.named_parameters() if p.requires_grad}
        saved = {
            _plain_name(k.removeprefix("state.").rsplit(".", 1)[0])
            for k in state
            if k.startswith("state.")
        }
        if own and saved and not own & saved:
            raise CheckpointError(
                "the saved optimizer state names none of this model's parameters (saved e.g. "
                f"{sorted(saved)[:3]}, this model has e.g. {sorted(own)[:3]})"
            )
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self._options())


class ModelWeights:
    """A model's weights as a checkpoint component, in Hugging Face's safetensors layout.

    ``state_fn`` gives the state dict to write (every rank calls it; Accelerate's
    ``get_state_dict`` gathers sharded weights there); by default the unwrapped model's own.
    A single stage is written with ``save_pretrained`` (config and tokenizer beside it), so
    ``from_pretrained`` loads the checkpoint directory; a pipeline stage writes its own
    safetensors shard, keyed by the unsplit model's parameter names, and rank 0 the config
    ``save_pretrained`` would. Either way a model that is not a transformers model (a wrapper,
    even one with a ``config`` attribute) gets no ``config.json``: its names are its own. The
    manifest records the model's class and any transformers model it holds (``forge export``).

    ``subset``: the model is one pipeline stage's part of the whole (its names are the whole
    model's). Loading then reads exactly its own names from any checkpoint of the model, of
    any split or none, and fails if one is missing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        state_fn: Any = None,
        *,
        max_shard_size: int | str = "2GB",
        subset: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.state_fn = state_fn
        self.max_shard_size = max_shard_size
        self.subset = subset

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.state_fn is not None:
            return self.state_fn()
        return unwrap_model(self.model).state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unwrap_model(self.model).load_state_dict(state)

    def write(self, writer: Any, state: dict[str, torch.Tensor], stage_file: str | None) -> None:
        """Write on the owning rank: the whole model, or one stage's shard."""
        if writer.is_main:
            writer.set_meta(**{MODEL_RECORD: describe_model(unwrap_model(self.model))})
        if stage_file is not None:
            writer.save_safetensors(stage_file, state)
            if writer.is_main:
                self.write_extras(writer)
            return
        writer.save_model(
            self.model,
            tokenizer=self.tokenizer,
            state_dict=state,
            max_shard_size=self.max_shard_size,
        )

    def write_extras(self, writer: Any) -> None:
        """What ``save_pretrained`` writes beside the weights: config, generation config (for
        a transformers model only: another module's names are not its config's class's)."""
        model = unwrap_model(self.model)
        if is_hf_model(model):
            prepare_config(model).save_pretrained(writer.path)
            if model.can_generate():
                model.generation_config.save_pretrained(writer.path)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(writer.path)

    def load_checkpoint(self, checkpoint: Path, manifest: Any) -> None:
        load_model_weights(self.model, checkpoint, strict=True, subset=self.subset)


class ShardedWeights:
    """A sharded model's weights as a checkpoint component (scope ``sharded``): every rank
    writes its rows of each parameter, rank 0 also the tensors that are whole on every rank
    (buffers). A tied weight is written once, under the name ``save_pretrained`` keeps, its
    other names recorded in the files' metadata. Loads from any checkpoint of the model,
    sharded or not.

    ``state_fn`` gives the state dict to split (a pipeline stage's own names; by default the
    model's), ``keeps_whole`` whether this rank writes what is whole on every rank (by default
    rank 0; a sharded pipeline stage's first replica)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        state_fn: Any = None,
        keeps_whole: bool | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.state_fn = state_fn
        self.keeps_whole = keeps_whole

    def state_dict(self) -> dict[str, Any]:
        state = self.state_fn() if self.state_fn is not None else self.model.state_dict()
        return split_state(
            without_tied_copies(self.model, state), keep_whole=_keeps_whole(self.keeps_whole)
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:  # loads through load_checkpoint
        raise NotImplementedError("sharded weights load from a checkpoint directory")

    def write(self, writer: Any, state: dict[str, Any], stage_file: str | None) -> None:
        if writer.is_main:  # the config (forge export builds the directory from it), tokenizer
            writer.set_meta(**{MODEL_RECORD: describe_model(self.model)})
            ModelWeights(self.model, self.tokenizer).write_extras(writer)
        metadata = {**tied_aliases(self.model), SHARDS_METADATA: json.dumps(state["layout"])}
        writer.save_safetensors(stage_file, state["tensors"], metadata=metadata)

    def load_checkpoint(self, checkpoint: Path, manifest: Any) -> None:
        load_sharded_weights(self.model, checkpoint, strict=True)


class ShardedOptimizerState:
    """An optimizer over DTensor parameters, keyed by parameter name like ``OptimizerState``;
    each rank saves its rows of the moments. Loads the whole state (merged from the shards
    of any number of ranks, or a plain checkpoint's) and keeps its own rows. ``keeps_whole``:
    as ``ShardedWeights``'."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        keeps_whole: bool | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.keeps_whole = keeps_whole

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        if not self.optimizer.state:  # no state: the groups' settings (see OptimizerState)
            flat = param_groups_by_name(self.model, self.optimizer)
        else:
            options = StateDictOptions(flatten_optimizer_state_dict=True)
            flat = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return split_state(flat, keep_whole=_keeps_whole(self.keeps_whole))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the whole state (keyed by parameter name, as ``OptimizerState`` saves it):
        each DTensor parameter's moments keep this rank's rows."""
        from torch.distributed.tensor import DTensor

        if not any(k.startswith("state.") for k in state):
            load_param_groups_by_name(self.model, self.optimizer, state)
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
                        # a copy of the rows: a view would keep (and torch.save write)
                        # every rank's rows of the whole moment
                        rows = value[offset : offset + local.shape[0]]
                        own[key] = DTensor.from_local(
                            rows.to(local.dtype, copy=True, memory_format=torch.contiguous_format),
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


# ---------------------------------------------------------------------------------------------
# which component saves the weights and the optimizer


def model_component(
    model: torch.nn.Module,
    tokenizer: Any = None,
    *,
    sharded: bool = False,
    state_fn: Any = None,
    subset: bool = False,
    adapter_base: dict[str, Any] | None = None,
    keeps_whole: bool | None = None,
) -> Component:
    """The checkpoint component of ``model``'s weights, written as safetensors: a peft model's
    adapter alone (``adapter_base``: the run's record of its frozen base), each rank's rows
    (``sharded``, scope sharded; ``keeps_whole``: whether this rank writes the tensors whole
    on every rank, default rank 0), else the whole model or one pipeline stage's part (scope
    stage); ``state_fn`` gives the tensors to write, ``subset`` loads only the names the model
    holds."""
    if is_peft_model(model):
        from forge.checkpoint.adapter import AdapterWeights

        return Component(
            "model", AdapterWeights(model, tokenizer, base=adapter_base), Scope.STAGE, weights=True
        )
    if sharded:
        weights = ShardedWeights(model, tokenizer, state_fn=state_fn, keeps_whole=keeps_whole)
        return Component("model", weights, Scope.SHARDED, weights=True)
    weights = ModelWeights(model, tokenizer, state_fn=state_fn, subset=subset)
    return Component("model", weights, Scope.STAGE, weights=True)


def optimizer_component(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sharded: bool = False,
    save: bool = True,
    restore: bool = True,
    fix: str = "",
    keeps_whole: bool | None = None,
) -> Component:
    """The checkpoint component of ``optimizer``'s state, keyed by parameter name: each rank's
    rows of the moments (``sharded``; ``keeps_whole`` as ``model_component``'s) or the whole
    state (scope stage)."""
    if sharded:
        state: Any = ShardedOptimizerState(model, optimizer, keeps_whole)
    else:
        state = OptimizerState(model, optimizer)
    scope = Scope.SHARDED if sharded else Scope.STAGE
    return Component("optimizer", state, scope, save=save, restore=restore, fix=fix)
