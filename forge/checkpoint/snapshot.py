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


class HostStaging:
    """Pinned host buffers that receive accelerator tensors, reused from one save to the next.

    An asynchronous save copies device state into these between two steps: pinned memory lets
    the copies run at the bus's speed without a pageable bounce, and reusing the buffers spares
    allocating (and pinning) the whole state at every save. ``reuse`` hands the buffers out
    again: call it only when no commit still reads the previous snapshot (at most one commit is
    in flight, and the next save waits for it first).
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[Any]] = {}
        self._taken: list[tuple[tuple, Any]] = []

    def reuse(self) -> None:
        for key, buffer in self._taken:
            self._free.setdefault(key, []).append(buffer)
        self._taken.clear()

    def take(self, like: Any) -> Any:
        """A pinned CPU tensor of ``like``'s shape and dtype, not handed out since ``reuse``."""
        import torch

        key = (tuple(like.shape), like.dtype)
        pool = self._free.get(key)
        buffer = pool.pop() if pool else torch.empty(key[0], dtype=like.dtype, pin_memory=True)
        self._taken.append((key, buffer))
        return buffer


def host_copy(obj: Any, staging: HostStaging | None = None, *, copy_cpu: bool = True) -> Any:
    """``obj`` (a state dict: dicts, lists and tuples of tensors and plain values) with every
    tensor copied to CPU memory: detached, contiguous and sharing no memory with ``obj``.

    Tensors that are the same tensor in ``obj`` (tied weights, one parameter under two names)
    are one tensor in the copy too, so writers that store shared tensors once still see it.
    Any other object is deep-copied. With ``staging``, CUDA tensors land in its pinned buffers
    (copied without blocking, then synchronised once before returning).

    ``copy_cpu=False`` (a synchronous save, whose commit ends before training touches the
    state again) keeps CPU tensors as they are, detached and contiguous, sparing a copy of
    the whole state; tensors on an accelerator are still copied to host memory.
    """
    import torch

    copies: dict[tuple, torch.Tensor] = {}
    pending: set[torch.device] = set()

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
        if found is None and not copy_cpu and item.device.type == "cpu":
            found = item.detach().contiguous()  # no copy when already contiguous
            copies[key] = found
        if found is None:
            if staging is not None and item.device.type == "cuda":
                found = staging.take(item)
                found.copy_(item.detach(), non_blocking=True)
                pending.add(item.device)
            else:
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

    result = walk(obj)
    for device in pending:  # the copies must have landed before the loop changes the source
        torch.cuda.synchronize(device)
    return result
