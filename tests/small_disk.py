"""A real, small filesystem for disk-full tests: a tmpfs mounted for the length of a test."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(directory: Path, size: str = "4m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``directory`` (created); skip the test if that is refused.

    Mounting needs root (or CAP_SYS_ADMIN); where it is refused the test is skipped with the
    reason ``mount`` gave, rather than passing without having filled a disk.
    """
    directory.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("cannot mount a small tmpfs to fill: no `mount` command")
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {reason}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)
