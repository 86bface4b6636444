"""A trial's training process, forked from a parent that imported torch, transformers and forge
once: Python's fork server (``multiprocessing``'s ``forkserver`` start method).

A fresh Python that imports torch and transformers spends seconds before it trains a step; a
sweep of short trials spent most of its time there. The first trial of a ``forge sweep`` starts
the fork server, a process of one thread that imports those modules and then waits; each trial
is a child it forks (``os.fork`` of a process that started no thread, so nothing is held by a
thread that the child lacks). The child is a process of its own, as ``forge train``'s is: a
session of its own (a signal reaches it once, forwarded by the sweep), its own CUDA devices and
CPU threads from its environment (nothing in the server touched CUDA or started torch's thread
pool), its output to the sweep's stderr or its run's ``sweep.log``, and its exit status as a
process's. A trial is killed when the sweep dies (it watches the sweep's pid, as a fresh trial's
parent death signal would), and the server exits then too, so a killed sweep leaves no trial
behind.

Where there is no fork server (not POSIX), or ``FORGE_SWEEP_FORK=0``, each trial is a fresh
``python -m forge.cli _worker`` as before.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from forge.lifetime import leave_without_shutdown

PARENT_ENV = "FORGE_PARENT_PID"  # forge.launch.torchrun's: the worker dies with this process
#: what the server imports once: what a trial's training process needs
PRELOAD = [
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "sympy",  # torch imports it on first use of its shape machinery
    "numpy.random",
    "psutil",
    "forge.cli",
    "forge.cli.commands",
    "forge.runs",
    "forge.launch.worker",
    "forge.launch.torchrun",
    "forge.train.trainers",
    "forge.train.loop",
    "forge.train.sanity",
    "forge.train.lora",
    "forge.data",
    "forge.checkpoint.manager",
    "forge.checkpoint.writer",
]
_LOCK = threading.Lock()
_CONTEXT: Any = None


def forking() -> bool:
    """Whether trials are forked from the fork server (else started as fresh processes)."""
    if os.environ.get("FORGE_SWEEP_FORK", "1") == "0":
        return False
    return "forkserver" in multiprocessing.get_all_start_methods()


def _context() -> Any:
    global _CONTEXT
    with _LOCK:
        if _CONTEXT is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _CONTEXT = context
        return _CONTEXT


class TrialProcess:
    """One trial's training process (``forge _worker`` on its run): forked from the fork
    server, or a fresh process; ``send_signal`` and ``wait`` as ``subprocess.Popen``'s."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path | None) -> None:
        if forking():
            self._process: Any = _context().Process(
                target=_run_trial,
                args=(argv, env, str(log) if log else None, os.getpid()),
                daemon=False,
            )
            self._process.start()
            self._popen = None
        else:
            self._process = None
            out = open(log, "a") if log else None  # noqa: SIM115 - closed in wait()
            command = [sys.executable, "-m", "forge.cli", *argv]
            self._out = out
            self._popen = subprocess.Popen(
                command,
                env={**env, PARENT_ENV: str(os.getpid())},
                stdout=out or sys.stderr,
                stderr=out or sys.stderr,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else self._popen.pid

    def send_signal(self, signum: int) -> None:
        if self._popen is not None:
            self._popen.send_signal(signum)
        elif self._process.exitcode is None:
            try:
                os.kill(self._process.pid, signum)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        """The exit status, as ``Popen.returncode`` gives it (-N for signal N)."""
        if self._popen is not None:
            try:
                return self._popen.wait()
            finally:
                if self._out is not None:
                    self._out.close()
        self._process.join()
        return self._process.exitcode


def _let_the_server_die_with_the_sweep() -> None:
    """multiprocessing hands each child the sweep's end of the pipe whose closing stops the
    server (so a child could start processes of its own through it); held here, it would keep
    the server, and so the trial, alive after the sweep is killed. A trial starts none."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


def _die_with(sweep: int) -> None:
    """SIGKILL this process when the process ``sweep`` ends, as a fresh trial's parent death
    signal does (a forked trial's parent is the server, which outlives the sweep by its exit):
    a thread waits on the sweep's pidfd (Linux), else polls it."""

    def watch() -> None:
        try:
            handle = os.pidfd_open(sweep)
        except ProcessLookupError:
            handle = -1  # already gone
        except (AttributeError, OSError):
            handle = None
        if handle is not None and handle >= 0:
            select.select([handle], [], [])
        while handle is None:
            try:
                os.kill(sweep, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forge-sweep-watch", daemon=True).start()


def _run_trial(argv: list[str], env: dict[str, str], log: str | None, sweep: int) -> None:
    """In the forked child: become the process a fresh ``forge _worker`` would be, and run."""
    _die_with(sweep)
    _let_the_server_die_with_the_sweep()
    os.setsid()  # a session of its own: a terminal's Ctrl-C reaches it once, forwarded
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    os.dup2(2, 1)  # stdout is the sweep's data: a trial's output goes with its log
    # it dies with the server, which dies with us
    run_as_a_command(argv, {**env, PARENT_ENV: str(os.getppid())})


def run_as_a_command(argv: list[str], env: dict[str, str]) -> NoReturn:
    """In a child forked from the fork server, its session and output set: become the process
    a fresh ``python -m forge.cli ARGV`` in ``env`` would be, run it, and leave as that process
    would (its non-daemon threads joined, then its exit handlers run)."""
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # the server's torch started before this environment was set
        import torch

        torch.set_num_threads(int(threads))
    leave_without_shutdown()  # the command's own entry need not prepare one
    code = _run_forge_command(argv)
    threading._shutdown()  # type: ignore[attr-defined]  # what an interpreter's exit does first
    atexit._run_exitfuncs()  # a forked child leaves by os._exit: what a process runs at exit
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _run_forge_command(argv: list[str]) -> int:
    """Run ``forge ARGV`` in this (forked) process, as the fresh-process path runs
    ``python -m forge.cli ARGV``: the command module is run by name, so the sweep, which the
    command line drives, does not import the command line itself."""
    sys.argv = ["forge", *argv]
    # A child of the fork server is left with the start method it was made by; a fresh process
    # has the platform's. Kept, it would start the command's own processes (its loader workers)
    # through the fork server, which cannot unpickle a dataset from the project's files.
    multiprocessing.set_start_method(None, force=True)
    try:
        runpy.run_module("forge.cli", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return int(stop.code or 0)
        print(stop.code, file=sys.stderr)
        return 1
    return 0
