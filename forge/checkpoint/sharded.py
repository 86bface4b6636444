"""State sharded across data-parallel ranks (FSDP2's DTensor parameters and optimizer moments),
saved by every rank as its own shard and read back by any topology.

Each rank writes only its local rows (FSDP2 shards dimension 0): the weights as
``model-shard-RRRRR-of-WWWWW.safetensors`` whose metadata gives each tensor's row offset and
whole shape, the optimizer state as a forge torch file with the same layout. Nothing is
gathered to one rank to save. A reader takes the rows it needs from whichever files hold them,
so a checkpoint of 2 shards loads into 2 ranks (each its own file), 3 ranks, one process, or a
plain checkpoint into a sharded model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from forge.checkpoint.io import CheckpointError, weight_files
from forge.checkpoint.layout import SHARDS_METADATA
from forge.wrappers import class_label


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """For each name of ``model``'s parameters and buffers that shares its tensor with another
    (tied weights: one parameter under several names), every such name, first the one
    ``named_parameters`` keeps (the name ``save_pretrained`` writes). Read from the modules,
    not the state dict: a sharded model's state dict gives each name a DTensor of its own."""
    holders: dict[tuple, list[str]] = {}
    for name, tensor in chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        if tensor is None:
            continue
        if tensor.numel() == 0 or tensor.device.type == "meta" or has_dtensors([tensor]):
            identity: tuple = (id(tensor),)
        else:  # two parameters over one storage are tied as well
            identity = (
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.dtype,
            )
        holders.setdefault(identity, []).append(name)
    return {name: group for group in holders.values() if len(group) > 1 for name in group}


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_piece(tensor: Any) -> tuple[torch.Tensor, int, list[int]]:
    """(this rank's rows, their offset in dimension 0, the whole shape) of a DTensor sharded
    on dimension 0 (FSDP2's layout; replicated along other mesh dimensions, as HSDP's), or of
    a whole tensor (offset 0)."""
    if not _is_dtensor(tensor):
        return tensor, 0, list(tensor.shape)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(
        not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0))
        for p in tensor.placements
    ):
        raise CheckpointError(f"a tensor sharded as {tensor.placements} cannot be saved by rows")
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return tensor.to_local(), 0, list(tensor.shape)
    _, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tensor.to_local(), int(offset[0]) if tensor.dim() else 0, list(tensor.shape)


def first_holder(tensor: Any) -> bool:
    """Whether this rank is the first of the ranks holding the same piece of ``tensor``: a
    DTensor replicated along a mesh dimension (HSDP's replicas) is held by one rank of each
    coordinate there, and only coordinate 0 writes it."""
    if not _is_dtensor(tensor):
        return True
    from torch.distributed.tensor import Replicate

    coordinate = tensor.device_mesh.get_coordinate() or []
    return all(
        c == 0
        for c, p in zip(coordinate, tensor.placements, strict=True)
        if isinstance(p, Replicate)
    )


def split_state(state: dict[str, Any], *, keep_whole: bool) -> dict[str, Any]:
    """A state dict as one rank's shard: ``tensors`` (its rows of each DTensor, and whole
    tensors where ``keep_whole``), ``layout`` (``name: [offset, *shape]``) and ``other``
    (plain values, where ``keep_whole``). Rows a replica holds as well are kept by the first
    replica's rank alone (``first_holder``). One rank keeps what every rank holds whole, so the
    shards sum to one process's state (a scalar step per parameter and an optimizer's flat
    settings are a tenth of a small model's moments)."""
    tensors, layout, other = {}, {}, {}
    for name, value in state.items():
        if _is_dtensor(value):
            if not first_holder(value):
                continue  # a replica's copy: the first replica writes these rows
            local, offset, shape = local_piece(value)
            tensors[name], layout[name] = local, [offset, *shape]
        elif isinstance(value, torch.Tensor):
            if keep_whole:
                tensors[name], layout[name] = value, [0, *value.shape]
        elif keep_whole:
            other[name] = value
    return {"tensors": tensors, "layout": layout, "other": other}


def merge_sharded(shards: list[Any]) -> dict[str, Any]:
    """Every rank's shard (``split_state``) of a saved component put back whole: a state dict
    keyed by name as the unsharded component has it."""
    merged: dict[str, Any] = {}
    pieces: dict[str, list[tuple[int, list[int], torch.Tensor]]] = {}
    for shard in shards:
        if not shard:
            continue
        for name, value in shard["other"].items():
            merged.setdefault(name, value)
        for name, tensor in shard["tensors"].items():
            offset, *shape = shard["layout"][name]
            pieces.setdefault(name, []).append((offset, shape, tensor))
    for name, found in pieces.items():
        merged[name] = _assemble(name, found)
    return merged


def _assemble(name: str, pieces: list[tuple[int, list[int], torch.Tensor]]) -> torch.Tensor:
    shape = pieces[0][1]
    if not shape:
        return pieces[0][2].clone()
    whole = torch.empty(shape, dtype=pieces[0][2].dtype)
    covered = 0
    for offset, _, rows in sorted(pieces, key=lambda piece: piece[0]):
        whole[offset : offset + rows.shape[0]] = rows
        covered = max(covered, offset + rows.shape[0])
    if covered != shape[0]:
        raise CheckpointError(f"the shards of {name!r} cover {covered} of its {shape[0]} rows")
    return whole


def is_sharded(file: Path) -> bool:
    """Whether a safetensors file holds one rank's rows (``SHARDS_METADATA``)."""
    from safetensors import safe_open

    with safe_open(file, framework="pt", device="cpu") as handle:
        return SHARDS_METADATA in (handle.metadata() or {})


class RowReader:
    """Rows of the weights in a checkpoint's safetensors files, sharded (``SHARDS_METADATA``)
    or whole; each read opens only the files that hold the rows asked for."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        files, aliases = weight_files(directory)
        named: dict[str, str] = dict(aliases)  # the index's and the files' metadata
        self.pieces: dict[str, list[tuple[Path, int, int]]] = {}  # name -> (file, offset, rows)
        self.shapes: dict[str, list[int]] = {}
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                metadata = handle.metadata() or {}
                layout = json.loads(metadata.get(SHARDS_METADATA, "{}"))
                named.update(metadata)
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    shape = list(handle.get_slice(name).get_shape())
                    offset, *whole = layout.get(name, [0, *shape])
                    rows = shape[0] if shape else 1
                    self.pieces.setdefault(name, []).append((file, offset, rows))
                    self.shapes[name] = whole
        # a tied name stored once -> the name that holds it (other metadata names no tensor)
        self.aliases = {k: v for k, v in named.items() if v in self.pieces and k not in self.pieces}

    def names(self) -> set[str]:
        return set(self.pieces)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of ``name`` (all of it by default)."""
        from safetensors import safe_open

        shape = self.shapes[name]
        if not shape:
            file = self.pieces[name][0][0]
            with safe_open(file, framework="pt", device="cpu") as handle:
                return handle.get_tensor(name)
        stop = shape[0] if stop is None else stop
        parts = []
        for file, offset, rows in sorted(self.pieces[name], key=lambda piece: piece[1]):
            low, high = max(start, offset), min(stop, offset + rows)
            if low >= high and not (start == stop == low):
                continue
            with safe_open(file, framework="pt", device="cpu") as handle:
                parts.append(handle.get_slice(name)[low - offset : high - offset])
            if start == stop:
                break
        if not parts:
            return torch.empty([0, *shape[1:]])
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def load_sharded_weights(model: torch.nn.Module, directory: Path, *, strict: bool = True) -> None:
    """Load a checkpoint's weights (sharded or whole, any number of shards) into a model
    whose parameters may be DTensors: each rank reads only its own rows. A tied weight is
    read under whichever of its names the checkpoint holds (``save_pretrained`` and the
    sharded save keep one)."""
    from torch.distributed.tensor import DTensor

    reader = RowReader(directory)
    saved = reader.names()
    ties = tied_names(model)
    expected = model.state_dict()
    source: dict[str, str] = {}  # a name of the model -> the name its tensor is saved under
    for name in expected:
        found = [n for n in (name, *ties.get(name, ()), reader.aliases.get(name)) if n in saved]
        if found:
            source[name] = found[0]
    missing = sorted(set(expected) - set(source))
    if strict and missing:
        raise CheckpointError(
            f"{directory}: weights do not match {class_label(model)} (missing keys: "
            f"{', '.join(missing[:5])})"
        )
    wrong = [
        f"{name} is {tuple(reader.shapes[source[name]])} in the checkpoint, "
        f"{tuple(value.shape)} in the model"
        for name, value in expected.items()
        if name in source and list(reader.shapes[source[name]]) != list(value.shape)
    ]
    if wrong:  # before reading: torch's copy error would give the model's shape for both
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise CheckpointError(
            f"{directory}: weights do not fit {class_label(model)}: {'; '.join(wrong[:3])}"
            f"{more}; the checkpoint was written for another configuration of the model"
        )
    state: dict[str, Any] = {}
    for name, value in expected.items():
        if name not in source:
            continue
        if isinstance(value, DTensor):
            local, offset, _ = local_piece(value)
            rows = reader.read(source[name], offset, offset + local.shape[0])
            state[name] = DTensor.from_local(
                rows.to(local.dtype),
                value.device_mesh,
                value.placements,
                shape=value.shape,
                stride=value.stride(),
            )
        else:
            state[name] = reader.read(source[name])
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{directory}: weights do not fit {class_label(model)}: {exc}"
        ) from exc


def without_tied_copies(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``model``'s state dict with each tied tensor under one name (the one
    ``save_pretrained`` keeps), as a whole model's save stores it."""
    ties = tied_names(model)
    return {name: value for name, value in state.items() if ties.get(name, [name])[0] == name}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each tied name that ``without_tied_copies`` leaves out -> the name that holds its
    tensor (written as safetensors metadata, as ``save_torch_state_dict`` records them)."""
    return {name: group[0] for name, group in tied_names(model).items() if group[0] != name}


def has_dtensors(tensors: Iterable[Any]) -> bool:
    return any(_is_dtensor(t) for t in tensors)
