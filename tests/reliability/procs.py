"""Processes of a running `forge` job, found through /proc (Linux), to kill them as a crash
would: the launcher, torchrun's agent and its workers each run in a session of their own."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # the field after the state


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and everything below it, all at once (as a machine crash would);
    returns the pids killed. The caller reaps ``pid`` itself if it is its child."""
    victims = [pid, *descendants(pid)]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


def worker_pids(root: int) -> dict[int, int]:
    """The training workers below ``root``, by rank (from their RANK environment variable)."""
    workers = {}
    for pid in descendants(root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"_worker" not in command:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                workers[int(item[5:])] = pid
    return workers


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"
