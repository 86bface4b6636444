"""Peak memory, as logged with the loss.

On a CUDA device: the caching allocator's peak of memory allocated to tensors and reserved
from the driver since the last log (the peak is reset after each read), in MiB. These are
the allocator's host-side counters: reading them never waits for the device. Elsewhere: the
process's peak resident set size since it started (the operating system keeps one peak per
process and offers no reset), in MiB.
"""

from __future__ import annotations

import sys

import torch

_MIB = 1024 * 1024
_peak_rss = 0  # the largest peak reported so far in this process


def peak_memory(device: torch.device) -> dict[str, float]:
    """``peak_memory_allocated_mb`` and ``peak_memory_reserved_mb`` on a CUDA device (since the
    previous call); ``peak_rss_mb`` elsewhere (since the process started); {} where neither
    can be read."""
    if device.type == "cuda" and torch.cuda.is_available():
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {
            "peak_memory_allocated_mb": round(allocated / _MIB, 1),
            "peak_memory_reserved_mb": round(reserved / _MIB, 1),
        }
    global _peak_rss
    rss = peak_rss_bytes()
    if rss is None:
        return {}
    # the kernel's counters are per-CPU and settle lazily: the peak it reports may dip by a few
    # pages after memory is freed; a peak never goes down
    _peak_rss = max(_peak_rss, rss)
    return {"peak_rss_mb": round(_peak_rss / _MIB, 1)}


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes; None where the platform has no
    ``resource`` module (Windows).

    On Linux the kernel's own peak of this address space (``VmHWM``): ``getrusage``'s
    ``ru_maxrss`` survives ``exec``, so a process started by a large one (a worker forked
    from a big launcher, a test runner's subprocess) would report its parent's peak."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
