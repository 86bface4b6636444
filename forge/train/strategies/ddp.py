"""DistributedDataParallel: every rank holds the whole model and trains on its shard of the
data; gradients are averaged over the ranks on each optimizer step's last micro-batch."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from forge.train.strategies.base import ParallelStrategy


class DataParallel(ParallelStrategy):
    """DDP around the model (around its compiled module when ``torch_compile`` is on), with
    the ``ddp_*`` arguments; ranks other than 0 write only their own random and data state."""

    ddp: DistributedDataParallel | None = None

    def parallelize(self, model: nn.Module, compiled: nn.Module | None) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(
            model if compiled is None else compiled, device_ids=device_ids, **self.args.ddp_kwargs()
        )
        self.wrapped = self.ddp
        return self.ddp

    def no_sync(self, last: bool) -> AbstractContextManager:
        """Gradients are all-reduced only on a window's last micro-batch."""
        if self.ddp is None or last:
            return nullcontext()
        return self.ddp.no_sync()

    def release(self) -> None:
        self.ddp = None
        super().release()
