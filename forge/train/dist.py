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


def resolve_device(spec: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device this rank trains on; ValueError says what is wrong with ``spec``.

    ``auto`` picks this rank's GPU when CUDA is available, else the CPU. ``cuda`` is GPU
    ``local_rank`` (the launcher's LOCAL_RANK), or GPU 0 when each process sees a single GPU
    (a launcher that sets CUDA_VISIBLE_DEVICES per rank). An explicit ``cuda:N`` in a job of
    several processes must be this rank's GPU: the same index on every rank would put every
    rank on one GPU, so it is an error rather than a silent remapping.
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(
            f"is {spec!r} but CUDA is not available (torch {torch.__version__}, "
            f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); "
            "use auto or cpu"
        )
    count = torch.cuda.device_count()
    if device.index is None:
        if local_rank < count:
            return torch.device("cuda", local_rank)
        if count == 1:
            return torch.device("cuda", 0)  # each process was given its own GPU
        raise ValueError(
            f"is {spec!r} on local rank {local_rank}, but this node has {count} GPUs; start at "
            f"most {count} processes per node (--nproc {count})"
        )
    if device.index >= count:
        raise ValueError(
            f"is {spec!r} but {count} GPU(s) are visible (cuda:0 to cuda:{count - 1}); "
            "use cuda (each rank its own GPU) or an index that exists"
        )
    if world_size > 1 and count > 1 and device.index != local_rank:
        raise ValueError(
            f"is {spec!r} on local rank {local_rank} of a {world_size}-process job: every rank "
            f"would train on GPU {device.index}; use cuda or auto, which give each rank the GPU "
            "of its LOCAL_RANK"
        )
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
    A CUDA device becomes the current one, so that libraries allocating on "the" GPU (NCCL,
    compiled kernels) use this rank's.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not topology.distributed or dist.is_initialized():
        yield False
        return
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
