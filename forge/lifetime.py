"""A process that dies with its parent (the kernel's parent-death signal, on Linux), and the
signals that ask a job to stop with a checkpoint.

forge's processes form a tree (forge -> torchrun -> a rank -> its data loader workers); when one
dies, however it dies, the processes below it must not outlive it (they would hold the run's
lock and its files). ``signal_on_parent_death`` asks the kernel to send a signal when the
parent dies; callers fall back to watching the parent where it is not available.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import multiprocessing
import multiprocessing.context as contexts
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

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


STOP_SIGNAL_ENV = "FORGE_STOP_SIGNAL"
DEFAULT_STOP_SIGNAL = signal.SIGUSR1
# signals that cannot ask a job to save: uncatchable, raised by faults, or the job's own plumbing
_NOT_STOP_SIGNALS = {"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGCONT", "SIGSEGV", "SIGBUS", "SIGFPE",
                     "SIGILL", "SIGPIPE", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGWINCH", "SIGURG"}  # fmt: skip


def parse_stop_signal(value: str) -> signal.Signals:
    """``USR1``, ``SIGUSR1`` or ``10`` -> ``signal.SIGUSR1``; ValueError naming the choices."""
    text = value.strip().upper()
    try:
        signum = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
        )
    except (KeyError, ValueError):
        signum = None
    if signum is None or signum.name in _NOT_STOP_SIGNALS:
        raise ValueError(
            f"--stop-signal must name a signal a scheduler sends to ask for a save, such as "
            f"USR1 (SLURM's --signal=USR1@90), USR2, HUP, QUIT or XCPU (got {value!r})"
        )
    return signum


def scheduler_signal() -> signal.Signals:
    """The scheduler's warning signal this job stops on (``FORGE_STOP_SIGNAL``, else SIGUSR1)."""
    value = os.environ.get(STOP_SIGNAL_ENV, "")
    return parse_stop_signal(value) if value else DEFAULT_STOP_SIGNAL


def stop_signals() -> tuple[signal.Signals, ...]:
    """Every signal that stops training with a checkpoint."""
    warning = scheduler_signal()
    return tuple(dict.fromkeys((signal.SIGINT, signal.SIGTERM, warning)))


def ignore_stop_signals() -> None:
    """For a helper process of a rank (a data loader worker): a scheduler signals every process
    of a job, and a worker that died of it would fail its rank before the rank has saved. It
    still dies with its rank (forge.lifetime's parent-death signal)."""
    for signum in stop_signals():
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # started with them held (helper_context)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals())


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold (block) the stop signals in this thread while the block runs: one that arrives
    meanwhile is delivered when it ends (to this process's handlers, as it would have been),
    and a process forked or spawned inside the block starts with them held too."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _StartsHeld:
    """A helper process started with the stop signals held, until it ignores them
    (``ignore_stop_signals``, its first act): between its fork and that first act a signal to
    the job's processes (a scheduler's, torchrun's ``killpg`` of a rank) would kill it with
    its default action, and its rank would fail before saving."""

    def start(self) -> None:
        if self._start_method != "fork":  # type: ignore[attr-defined]
            # the first spawn starts multiprocessing's resource tracker, which unblocks
            # SIGINT and SIGTERM in this thread when it has: started first, outside the hold
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        with stop_signals_held():
            super().start()  # type: ignore[misc]


if sys.platform != "win32":

    class _ForkProcess(_StartsHeld, contexts.ForkProcess):
        pass

    class _SpawnProcess(_StartsHeld, contexts.SpawnProcess):
        pass

    class _ForkServerProcess(_StartsHeld, contexts.ForkServerProcess):
        pass

    class _ForkContext(contexts.ForkContext):
        Process = _ForkProcess

    class _SpawnContext(contexts.SpawnContext):
        Process = _SpawnProcess

    class _ForkServerContext(contexts.ForkServerContext):
        Process = _ForkServerProcess

    _HELD = {"fork": _ForkContext, "spawn": _SpawnContext, "forkserver": _ForkServerContext}
else:
    _HELD = {}


def helper_context(method: str | None = None) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context (start ``method``, or this process's default) whose
    processes start with the stop signals held: torch ``DataLoader``'s ``multiprocessing_context``
    for workers whose ``worker_init_fn`` ignores those signals (forge.data.loader's
    ``die_with_parent``). With ``forkserver`` the workers are forked by the server process,
    which holds them only if it was started here."""
    context = multiprocessing.get_context(method)
    held = _HELD.get(context.get_start_method())
    return held() if held is not None else context


def kill_helpers_at_exit() -> None:
    """Have this process SIGKILL its daemonic ``multiprocessing`` children (data loader
    workers) when it exits. Python's own exit sends them SIGTERM and waits for them, which
    those that ignore the stop signals (:func:`ignore_stop_signals`) would never answer.
    Registered once; it runs before multiprocessing's own exit handler (atexit's order)."""
    global _KILLS_HELPERS
    if not _KILLS_HELPERS:
        atexit.register(_kill_helpers)
        _KILLS_HELPERS = True


_KILLS_HELPERS = False


def _kill_helpers() -> None:
    import multiprocessing

    helpers = [child for child in multiprocessing.active_children() if child.daemon]
    if helpers and hasattr(signal, "SIGCHLD"):
        # torch's loader watches its workers with a SIGCHLD handler that raises when one is
        # killed; at exit there is nothing left to watch
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in helpers:
        child.kill()


_LEAVES_WITHOUT_SHUTDOWN = False


def leave_without_shutdown() -> None:
    """This process will end by ``os._exit`` (a child forked by multiprocessing, as a sweep's
    trial is): there is no shutdown for :func:`prepare_a_quick_exit` to shorten."""
    global _LEAVES_WITHOUT_SHUTDOWN
    _LEAVES_WITHOUT_SHUTDOWN = True


def prepare_a_quick_exit() -> None:
    """Spare the interpreter's shutdown its garbage collections over everything torch and
    transformers created, a few seconds of one core at every exit of a forge process (the
    command, the agent, each rank). What is garbage now is collected, so it is finalized as it
    would have been; what is left is frozen, and the shutdown's collections pass over it. Every
    object is still released by its reference count and every atexit handler runs. For a
    process's own entry point only: a frozen object is never collected."""
    if _LEAVES_WITHOUT_SHUTDOWN:
        return
    gc.collect()
    gc.freeze()
