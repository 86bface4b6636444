"""Shared test helpers: running forge through its real entry point."""

from __future__ import annotations

import os
import subprocess
import sys
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
    """Run `python -m forge.cli ARGS` and return the CompletedProcess (text mode)."""
    full_env = dict(os.environ)
    full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    full_env.setdefault("OMP_NUM_THREADS", "1")  # tiny models: threads cost more than they give
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "forge.cli", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
