"""Shared test helpers: running forge through its real entry point."""

from __future__ import annotations

import contextlib
import locale
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_LM = REPO / "projects" / "tiny_lm"


def run_python(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -c CODE ARGS`` in a fresh interpreter at the repository (text mode): for
    what only a process of its own shows (its imports, its exit)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_forge(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    """Run `python -m forge.cli ARGS` and return the CompletedProcess (text mode).

    The command is a process of its own either way. Without ``env`` it is forked from a server
    that imported torch, transformers and forge once, as ``forge sweep`` starts its trials
    (forge/sweep/trial_process.py): the seconds a fresh Python spends importing them were most
    of a short command's time. ``env``, an environment other than the one the server started
    in, or ``FORGE_TEST_FRESH=1`` runs a fresh ``python -m forge.cli`` instead: what is read
    from the environment at import time is then read as the command would read it.
    """
    full_env = _command_env()
    if env is None and _forks_for(full_env):
        return _run_forked(list(args), cwd or REPO, full_env, timeout)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "forge.cli", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def forks() -> bool:
    """Whether ``run_forge`` without ``env`` forks its command from the server now."""
    return _forks_for(_command_env())


def _command_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads cost more than they give
    return env


FRESH_ENV = "FORGE_TEST_FRESH"  # 1: every run_forge is a fresh `python -m forge.cli`
_SERVER: dict = {}  # "context": the fork server's multiprocessing context, "env": its environment


def _forks_for(env: dict) -> bool:
    """Whether run_forge forks a command running in ``env`` from this process's fork server."""
    if env.get(FRESH_ENV) == "1" or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    if "context" not in _SERVER:
        from multiprocessing import forkserver

        from forge.sweep.trial_process import PRELOAD

        if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
            return False  # another started it, in an environment not known here
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _SERVER.update(context=context, env=_import_time(env))
    return _import_time(env) == _SERVER["env"]


def _import_time(env: dict) -> dict:
    """``env`` less what pytest changes for each test (read by nothing at import time)."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def _run_forked(args: list[str], cwd: Path, env: dict, timeout: int):
    command = [sys.executable, "-m", "forge.cli", *args]
    with tempfile.TemporaryDirectory(prefix="forge-run-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        process = _SERVER["context"].Process(
            target=_forked_command, args=(args, str(cwd), env, str(out), str(err)), daemon=False
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:  # its process group: the command and its loader workers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.join()
            raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(command, process.exitcode, _read(out), _read(err))


def _read(path: Path) -> str:
    return path.read_text(encoding=locale.getpreferredencoding(False)) if path.exists() else ""


def _forked_command(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked child: `python -m forge.cli ARGS` started in ``cwd`` with ``env``, its
    output in ``out`` and ``err``."""
    from forge.sweep.trial_process import run_as_a_command

    os.setsid()  # as subprocess.run's child of a test: nothing signals its group but a timeout
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    run_as_a_command(args, env)
