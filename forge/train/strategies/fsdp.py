"""FSDP2 (``torch.distributed.fsdp.fully_shard``): the plain trainer's strategy when ``fsdp`` is
set and the job has several ranks. Each block (by default the model's repeated layers) is
sharded on its own, then the root, so only one block's parameters are gathered at a time; every
parameter becomes a DTensor holding 1/N of its rows on each rank, and so do its gradient and
optimizer state. Each rank saves its own rows (checkpoint scope ``sharded``)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from forge.checkpoint import Component
from forge.checkpoint.components import model_component, optimizer_component
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.args.fsdp import FsdpSettings
from forge.train.strategies.base import ParallelStrategy
from forge.train.transforms import checkpointed_blocks, repeated_layers, selection_problem
from forge.wrappers import class_label


def sharded_blocks(
    model: nn.Module, settings: FsdpSettings, args: TrainingArguments
) -> list[tuple[str, nn.Module]]:
    """The blocks sharded one by one: ``fsdp_config``'s modules (paths or class names), else
    the model's repeated layers, of every stack (T5: the encoder's and the decoder's; none: the
    model is sharded as one unit)."""
    names = settings.modules
    if names is None:
        found = repeated_layers(model)
        return checkpointed_blocks(model, args, found) if found else []
    modules = dict(model.named_modules())
    kind, key = class_label(model), "fsdp_config.transformer_layer_cls_to_wrap / modules"
    problems = [
        problem
        for name in names
        if (problem := selection_problem(modules, name, kind, args, key)) is not None
    ]
    if problems:
        raise TrainingArgumentsError(problems)
    return checkpointed_blocks(model, args, names)


def sharding_mesh(settings: FsdpSettings, device: torch.device, node_size: int) -> Any:
    """The device mesh the model is sharded on: every rank (1-D), or for a hybrid strategy
    (HSDP) ``replicate`` x ``shard`` (2-D; by default the ranks of a node shard and the nodes
    replicate, so all-gathers and reduce-scatters stay within a node and only the gradient
    all-reduce crosses nodes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not settings.hybrid:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    try:
        replicate, shard = settings.hybrid_mesh(world, node_size)
    except ValueError as exc:
        raise TrainingArgumentsError([f"trainer.args.{exc}"]) from None
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=MESH_DIMS)


#: the names of a hybrid mesh's dimensions (outer: replicas, inner: shards)
MESH_DIMS = ("replicate", "shard")


def describe_mesh(mesh: Any) -> str:
    if mesh.ndim == 1:
        return f"over {mesh.size()} ranks"
    replicate, shard = mesh.shape
    return f"on a {replicate} x {shard} mesh ({replicate} replicas of {shard} shards)"


def apply_fully_shard(
    model: nn.Module,
    settings: FsdpSettings,
    device: torch.device,
    args: TrainingArguments,
    node_size: int = 0,
    *,
    mesh: Any = None,
) -> str:
    """Shard ``model`` in place over ``mesh`` (default: ``sharding_mesh``); a line saying
    what was sharded."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = sharding_mesh(settings, device, node_size)
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": settings.reshard_after_forward,
    }
    if settings.param_dtype or settings.reduce_dtype:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=_dtype(settings.param_dtype), reduce_dtype=_dtype(settings.reduce_dtype)
        )
    if settings.offload_params:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    blocks = sharded_blocks(model, settings, args)
    for _, block in blocks:
        # before fully_shard's own hook, which registers on the outputs it is given
        block.register_forward_hook(_copy_returned_views, prepend=True)
        fully_shard(block, **options)
    # the root's parameters (embeddings, head) stay gathered after forward: backward needs
    # them at once, as torchtitan does
    fully_shard(model, **{**options, "reshard_after_forward": False})
    names = [name for name, _ in blocks]
    span = ", ".join(names[:2]) + (f", ..., {names[-1]}" if len(names) > 2 else "")
    return (
        f"FSDP2 {settings.strategy} {describe_mesh(mesh)}: {len(blocks)} blocks "
        f"({span or 'none'}) and the root"
    )


def _copy_returned_views(module: nn.Module, inputs: Any, output: Any) -> Any:
    """A sharded block's output with each view that needs a gradient replaced by a copy.

    FSDP2 hooks a block's outputs to gather its parameters again for the backward pass, and
    warns on an output that is a view: an in-place op on it would lose the hook. T5's first
    block returns such a view for the later blocks to reuse (its relative position bias, a
    permute of an embedding's output), so every T5 run warned. The copy is small (T5: one
    1 x heads x length x length tensor per stack and forward), the later blocks pass the copy
    on, and gradients are unchanged."""
    from torch.distributed.utils import _apply_to_tensors

    def copied(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone() if tensor.requires_grad and tensor._base is not None else tensor

    return _apply_to_tensors(copied, output)


def _dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def global_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm over DTensors, as a plain tensor every rank holds."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class FullyShard(ParallelStrategy):
    """The model sharded in place over every rank (``fsdp_settings``); the training step calls
    it (compiled or not) as it is."""

    collective_forward = True

    def __init__(
        self, args: TrainingArguments, topology: Any, device: torch.device, settings: FsdpSettings
    ) -> None:
        super().__init__(args, topology, device)
        self.settings = settings
        self.sharded: nn.Module | None = None

    def parallelize(self, model: nn.Module, compiled: nn.Module | None) -> nn.Module:
        line = apply_fully_shard(
            model, self.settings, self.device, self.args, self.topology.node_size
        )
        self.info("%s", line)
        self.sharded = model
        return super().parallelize(model, compiled)

    def no_sync(self, last: bool) -> AbstractContextManager:
        """Gradients are reduce-scattered only on a window's last micro-batch (FSDP2 has a
        flag, no context)."""
        if self.sharded is not None:
            self.sharded.set_requires_gradient_sync(last)
        return nullcontext()

    def clip_gradients(self, model: nn.Module, optimizer: Optimizer) -> torch.Tensor:
        """The global norm: over DTensor gradients, every rank's shards."""
        return global_norm(super().clip_gradients(model, optimizer))

    def eval_forwards(self, count: int) -> int:
        """A sharded model's forward gathers parameters with every rank: each runs as many
        evaluation forwards as the rank with the most batches."""
        return int(self.agree_max(float(count)))

    def model_component(self, model: nn.Module, tokenizer: Any, adapter_base: Any) -> Component:
        """Every rank its rows of the weights."""
        return model_component(model, tokenizer, sharded=True)

    def optimizer_component(self, model: nn.Module, optimizer: Optimizer) -> Component:
        return optimizer_component(model, optimizer, sharded=True, **self.optimizer_flags())

    def release(self) -> None:
        self.sharded = None
        super().release()
