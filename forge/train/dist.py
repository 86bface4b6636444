"""Process-group helpers for trainers launched by torchrun (or run as a single process)."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from forge.train.topology import Topology

logger = logging.getLogger(__name__)


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """``auto`` picks this rank's GPU when CUDA is available, else the CPU."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def process_group(
    topology: Topology, device: torch.device, backend: str | None, timeout_s: int | None = None
) -> Iterator[bool]:
    """Initialise the default process group for a multi-rank job unless one exists.

    Yields whether this call created it; a group it created is destroyed on exit.
    ``backend`` None means nccl on CUDA, gloo otherwise; ``timeout_s`` bounds each collective.
    """
    if not topology.distributed or dist.is_initialized():
        yield False
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    dist.init_process_group(
        backend=backend, rank=topology.rank, world_size=topology.world_size, timeout=timeout
    )
    try:
        yield True
        dist.barrier()  # no collective is still in flight when the group goes
    finally:
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks (``sum`` or ``max``); a no-op on one process."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    """Wait for every rank; a no-op on one process."""
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable values only; paths, small dicts)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (picklable values; a list of one on one process)."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
