"""A process that dies with its parent: the kernel's parent-death signal, on Linux.

forge's processes form a tree (forge -> torchrun -> a rank -> its data loader workers); when one
dies, however it dies, the processes below it must not outlive it (they would hold the run's
lock and its files). ``signal_on_parent_death`` asks the kernel to send a signal when the
parent dies; callers fall back to watching the parent where it is not available.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def signal_on_parent_death(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux; it fires
    when the parent *thread* that started this process ends). False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
