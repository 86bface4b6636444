"""Copying a component's state to host memory: the first phase of a save.

A save snapshots every component's state in the training thread, then commits the copy to
files (possibly while training goes on): the copy must not change when the next optimizer step
changes the parameters, the moments or the generators it was taken from.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def host_copy(obj: Any) -> Any:
    """``obj`` (a state dict: dicts, lists and tuples of tensors and plain values) with every
    tensor copied to CPU memory: detached, contiguous and sharing no memory with ``obj``.

    Tensors that are the same tensor in ``obj`` (tied weights, one parameter under two names)
    are one tensor in the copy too, so writers that store shared tensors once still see it.
    Any other object is deep-copied.
    """
    import torch

    copies: dict[tuple, torch.Tensor] = {}

    def tensor(item: torch.Tensor) -> torch.Tensor:
        if item.device.type == "meta":
            return item  # no data to copy (a stage's absent part)
        key = (
            item.untyped_storage().data_ptr(),
            item.device,
            item.storage_offset(),
            tuple(item.shape),
            item.stride(),
            item.dtype,
        )
        found = copies.get(key)
        if found is None:
            found = item.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            copies[key] = found
        return found

    def walk(item: Any) -> Any:
        if isinstance(item, _PLAIN):
            return item
        if isinstance(item, torch.Tensor):
            return tensor(item)
        if isinstance(item, OrderedDict):
            ordered = OrderedDict((k, walk(v)) for k, v in item.items())
            if hasattr(item, "_metadata"):  # a module state dict's versions, as torch keeps them
                ordered._metadata = copy.deepcopy(item._metadata)  # type: ignore[attr-defined]
            return ordered
        if isinstance(item, Mapping):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, list):
            return [walk(v) for v in item]
        if isinstance(item, tuple):
            values = [walk(v) for v in item]
            return type(item)(*values) if hasattr(item, "_fields") else tuple(values)
        return copy.deepcopy(item)

    return walk(obj)
