"""The plain trainer: one process, or DistributedDataParallel across the ranks torchrun starts."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from forge.train.base import BaseTrainer


class Trainer(BaseTrainer):
    """Train a model in one process, or with DDP under ``torchrun`` (``WORLD_SIZE`` > 1).

    Under torchrun the trainer creates the process group if none exists (gloo on CPU, nccl
    on CUDA, or ``args.ddp_backend``) and destroys it at the end, wraps the model in DDP,
    gives every rank its shard of the data, and lets only rank 0 log, report and write shared
    checkpoint files; every rank writes its own random and data state. See ``BaseTrainer``
    for the arguments.
    """

    trainer_kind = "plain"

    _ddp: DistributedDataParallel | None = None

    def parallelize(self, model: nn.Module) -> nn.Module:
        """DistributedDataParallel when there are several ranks (around the compiled module
        when ``torch_compile`` is on)."""
        self._ddp = None
        if self.topology.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(
                model, device_ids=device_ids, **self.args.ddp_kwargs()
            )
            return self._ddp
        return model

    def no_sync(self, last: bool) -> AbstractContextManager:
        """Gradients are all-reduced only on a window's last micro-batch."""
        if self._ddp is None or last:
            return nullcontext()
        return self._ddp.no_sync()

    def release_wrappers(self) -> None:
        self._ddp = None
        super().release_wrappers()
