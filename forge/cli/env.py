"""What ``forge env`` prints: what a bug report needs (versions, devices, backends)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from importlib import metadata

from forge.runs import PACKAGES


def environment_report() -> Iterator[tuple[str, str]]:
    yield "python", f"{sys.version.split()[0]} ({sys.executable})"
    yield "platform", platform.platform()
    yield "cpus", str(os.cpu_count())
    for name in PACKAGES:
        try:
            yield name, metadata.version(name)
        except metadata.PackageNotFoundError:
            yield name, "not installed"
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return
    yield "torch threads", str(torch.get_num_threads())
    yield "cuda available", str(torch.cuda.is_available())
    if torch.cuda.is_available():
        yield "cuda version", str(torch.version.cuda)
        for index in range(torch.cuda.device_count()):
            yield f"cuda:{index}", torch.cuda.get_device_name(index)
    mps = getattr(torch.backends, "mps", None)
    yield "mps available", str(bool(mps and mps.is_available()))
    backends = [
        name
        for name, available in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if available
    ]
    yield "distributed backends", ", ".join(backends) or "none"
