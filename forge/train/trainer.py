"""The plain trainer: one process, or DistributedDataParallel across the ranks torchrun starts."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from forge.checkpoint import Component, Scope
from forge.checkpoint.sharded_state import ShardedOptimizerState, ShardedWeights
from forge.train.base import BaseTrainer, _start_fresh


class Trainer(BaseTrainer):
    """Train a model in one process, or with DDP under ``torchrun`` (``WORLD_SIZE`` > 1).

    Under torchrun the trainer creates the process group if none exists (gloo on CPU, nccl
    on CUDA, or ``args.ddp_backend``) and destroys it at the end, wraps the model in DDP (or
    shards it with FSDP2 when ``args.fsdp`` is set: forge/train/fsdp.py),
    gives every rank its shard of the data, and lets only rank 0 log, report and write shared
    checkpoint files; every rank writes its own random and data state. See ``BaseTrainer``
    for the arguments.
    """

    trainer_kind = "plain"

    _ddp: DistributedDataParallel | None = None
    _sharded: nn.Module | None = None  # the model, sharded by FSDP2 in place

    def parallelize(self, model: nn.Module) -> nn.Module:
        """DistributedDataParallel when there are several ranks (around the compiled module
        when ``torch_compile`` is on), or FSDP2 when ``fsdp`` is set: the model is sharded in
        place and the training step calls it (compiled or not) as it is."""
        self._ddp = self._sharded = None
        settings = self.args.fsdp_settings()
        if settings is not None and self.topology.distributed:
            from forge.train.fsdp import apply_fully_shard

            self._info("%s", apply_fully_shard(self.model, settings, self.device, self.args))
            self._sharded = self.model
            return model
        if settings is not None:
            self._info("fsdp: one process holds the whole model; nothing to shard")
        if self.topology.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(
                model, device_ids=device_ids, **self.args.ddp_kwargs()
            )
            return self._ddp
        return model

    def no_sync(self, last: bool) -> AbstractContextManager:
        """Gradients are all-reduced (reduce-scattered, sharded) only on a window's last
        micro-batch."""
        if self._sharded is not None:
            self._sharded.set_requires_gradient_sync(last)  # FSDP2 has a flag, no context
            return nullcontext()
        if self._ddp is None or last:
            return nullcontext()
        return self._ddp.no_sync()

    def clip_gradients(self) -> torch.Tensor:
        """The global norm: over DTensor gradients, every rank's shards."""
        from forge.train.fsdp import global_norm

        return global_norm(super().clip_gradients())

    def eval_forwards(self, count: int) -> int:
        """A sharded model's forward gathers parameters with every rank: each runs as many
        evaluation forwards as the rank with the most batches."""
        if self._sharded is None:
            return count
        return int(self._agree_max(float(count)))

    def model_component(self) -> Component:
        """Sharded weights (every rank its rows) under FSDP2, else as the base saves them."""
        if self._sharded is None:
            return super().model_component()
        return Component(
            "model", ShardedWeights(self.model, self.tokenizer), Scope.SHARDED, weights=True
        )

    def optimizer_component(self) -> Component:
        if self._sharded is None:
            return super().optimizer_component()
        args = self.args
        return Component(
            "optimizer",
            ShardedOptimizerState(self.model, self.optimizer),
            Scope.SHARDED,
            save=args.save_optimizer_state,
            restore=args.restore_optimizer_state,
            fix=_start_fresh(args.config_key, "restore_optimizer_state"),
        )

    def release_wrappers(self) -> None:
        self._ddp = None
        super().release_wrappers()
