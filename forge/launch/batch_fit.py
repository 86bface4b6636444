"""The largest per-device batch that fits a memory, for the plan ``forge train --dry-run``
prints: the model state the plan counts (weights, gradients, optimizer state, the moving
average) plus activations measured on one real micro-batch.

The activations are the tensors autograd saves for the backward pass, summed once per storage
(``torch.autograd.graph.saved_tensors_hooks``; the parameters, which a layer saves too, are
left out), over one forward and backward of a batch of ``per_device_train_batch_size`` rows from
the training dataset, under bf16/fp16 autocast when the arguments ask for it. They grow with the
rows, so a batch of ``n`` rows takes ``n`` times the bytes per row. Not counted: the
temporaries of a kernel, the caching allocator's rounding and fragmentation, and what
activation checkpointing saves (the model is measured without it): leave a margin.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}


def parse_memory(text: str) -> int:
    """Bytes of a size such as ``16GiB``, ``80GB``, ``512M`` (K/M/G/T alone are binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"--memory must be a positive size such as 16GiB, 80GB or 512MiB (got {text!r})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Activations:
    """Bytes autograd saved for one micro-batch of ``rows`` rows."""

    saved: int
    rows: int

    @property
    def per_row(self) -> float:
        return self.saved / self.rows


def measure_activations(model: Any, batch: Mapping[str, Any], autocast: Any = None) -> int:
    """Bytes of the tensors autograd saves in ``model(**batch)``'s forward (each storage once,
    the parameters left out); runs the backward too, so what it measured is freed."""
    import contextlib

    import torch

    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with autocast if autocast is not None else contextlib.nullcontext():
            outputs = model(**batch)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise ValueError("the model's outputs have no loss to run the backward from")
    loss.backward()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in saved.items() if pointer not in weights)


def measure_micro_batch(build: Any, trainer: Any, args: Any) -> Activations:
    """The activations of one real micro-batch of the config's trainer: its model built for
    real (seeded), ``per_device_train_batch_size`` items of its training dataset through its
    collator."""
    import torch
    from torch import nn
    from torch.utils.data import default_collate

    torch.manual_seed(int(getattr(args, "seed", 0) or 0))
    model = build(trainer.kwargs["model"])
    model = model if isinstance(model, nn.Module) else model()
    model.train()
    dataset = build(trainer.kwargs["train_dataset"])
    node = trainer.kwargs.get("data_collator")
    collate = build(node) if node is not None else default_collate
    rows = min(int(args.per_device_train_batch_size), len(dataset))
    batch = collate([dataset[index] for index in range(rows)])
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else None
    return Activations(measure_activations(model, batch, autocast), rows)


def device_memory() -> int | None:
    """The first CUDA device's memory, where there is one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def largest_batch(memory: int, state: int, activations: Activations) -> int:
    """The most rows per device whose activations fit beside the model state (0: none)."""
    if activations.per_row <= 0:
        return 0 if memory < state else -1  # -1: the activations do not grow with the rows
    return max(int((memory - state) // activations.per_row), 0)


@dataclass(frozen=True)
class BatchFit:
    """What the plan's batch-fit line needs: the memory (None: not given, no GPU to read),
    where it came from, and the measured activations or why they were not measured."""

    memory: int | None
    source: str
    activations: Activations | str

    def line(self, state: int) -> str:
        """The plan's line: the largest per-device batch beside ``state`` bytes of model
        state."""
        from forge.checkpoint.io import format_bytes as human_bytes  # the plan's binary units

        head = "  batch fit     "
        if self.memory is None:
            return (
                head + "give --memory SIZE (e.g. 16GiB) for the largest per-device batch that "
                "fits: there is no GPU here to read it from"
            )
        where = f"in {human_bytes(self.memory)} ({self.source})"
        measured = self.activations
        if isinstance(measured, str):
            return f"{head}{where}: not measured ({measured})"
        rows = largest_batch(self.memory, state, measured)
        figures = (
            f"model state {human_bytes(state)} + activations {human_bytes(measured.per_row)} "
            f"per row, measured on a micro-batch of {measured.rows}"
        )
        if rows < 0:
            return f"{head}{where}: any batch ({figures}); kernel temporaries not counted"
        if rows == 0:
            return f"{head}{where}: not one row fits ({figures})"
        return (
            f"{head}{where}: up to {rows} per device ({figures}; kernel temporaries and the "
            "allocator's overhead not counted)"
        )
