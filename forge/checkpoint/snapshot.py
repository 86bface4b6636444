"""Copying a component's state to host memory: the first phase of a save.

A save snapshots every component's state in the training thread, then commits the copy to
files (possibly while training goes on): the copy must not change when the next optimizer step
changes the parameters, the moments or the generators it was taken from.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
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


class HostCopier:
    """How a snapshot copies tensors to host memory (``host_copy``; the default: plain copies).

    ``copy_cpu=False``: a synchronous save, whose commit ends before training touches the
    state again, keeps CPU tensors as they are (detached, contiguous): the copy is needless.

    ``staging``: CUDA tensors land in its reused pinned buffers (copied without blocking,
    synchronised once before the snapshot returns).

    ``deferrable``: CPU tensors for which it returns True (those only the optimizer step
    changes, in place) get an empty destination at once and are copied by ``copy_deferred``,
    which an async save's commit thread runs first, while the loop computes the next forward
    and backward; the loop calls ``wait_copied`` before its next optimizer step. Every other
    tensor (module buffers such as running statistics change in the forward) is copied at once.
    """

    def __init__(
        self,
        *,
        copy_cpu: bool = True,
        staging: HostStaging | None = None,
        deferrable: Callable[[Any], bool] | None = None,
    ) -> None:
        self.copy_cpu = copy_cpu
        self.staging = staging
        self.deferrable = deferrable
        self._deferred: list[tuple[Any, Any]] = []
        self._copied = threading.Event()
        self._copied.set()

    def defer(self, source: Any) -> Any:
        import torch

        target = torch.empty(source.shape, dtype=source.dtype)  # pages are touched by the copy
        self._deferred.append((target, source.detach()))
        self._copied.clear()
        return target

    def copy_deferred(self) -> None:
        """Copy what ``defer`` left (any thread; torch releases the GIL while it copies)."""
        try:
            for target, source in self._deferred:
                target.copy_(source)
        finally:
            self._deferred.clear()
            self._copied.set()  # also on failure: the loop must not wait forever

    def wait_copied(self) -> None:
        self._copied.wait()


def stepped_by(optimizer: Any) -> Callable[[Any], bool]:
    """Whether a tensor shares memory with what ``optimizer.step()`` changes in place (its
    parameters and its state): a HostCopier's ``deferrable``."""
    import torch

    stepped = {p for group in optimizer.param_groups for p in group["params"]}
    stepped |= {
        t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    }
    storages = {t.untyped_storage().data_ptr() for t in stepped if t.numel()}
    return lambda t: t.numel() > 0 and t.untyped_storage().data_ptr() in storages


def compact(tensor: Any) -> Any:
    """``tensor`` itself where it is contiguous and its storage holds nothing else, else a
    contiguous copy of its own bytes. ``torch.save`` writes a tensor's whole storage: a view
    (one rank's rows of a moment loaded whole, a slice of a merged state) would write every
    other rank's rows as well, silently, at every save."""
    import torch

    own = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == own:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def host_copy(obj: Any, copier: HostCopier | None = None) -> Any:
    """``obj`` (a state dict: dicts, lists and tuples of tensors and plain values) with every
    tensor copied to CPU memory: detached, contiguous and sharing no memory with ``obj``
    (a kept CPU tensor is compacted: ``compact``)
    (``copier`` may keep CPU tensors, stage CUDA ones or defer copies: see HostCopier).

    Tensors that are the same tensor in ``obj`` (tied weights, one parameter under two names)
    are one tensor in the copy too, so writers that store shared tensors once still see it.
    Any other object is deep-copied.
    """
    import torch

    copier = copier if copier is not None else HostCopier()
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
        if found is not None:
            return found
        if item.device.type == "cpu" and not copier.copy_cpu:
            found = compact(item.detach())  # no copy when it already owns just its bytes
        elif item.device.type == "cpu" and copier.deferrable and copier.deferrable(item):
            found = copier.defer(item)
        elif copier.staging is not None and item.device.type == "cuda":
            found = copier.staging.take(item)
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
