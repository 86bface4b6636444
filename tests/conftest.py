"""Suite-wide checks: no test may leave a file in the repository.

A test that writes into the working directory (an imported module creating a file, a run
without a temporary output directory) leaves it in the checkout, where it can be committed by
accident (an empty ``pwned`` once was). The files git does not ignore are listed before and
after the session; any new one fails the run, named.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def untracked_files() -> set[str] | None:
    """Files of the checkout that git neither tracks nor ignores (None: not a git checkout)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    result = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        return None
    return {name for name in result.stdout.decode().split("\0") if name}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._forge_untracked_before = untracked_files()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = getattr(session.config, "_forge_untracked_before", None)
    after = untracked_files()
    if before is None or after is None:
        return
    left = sorted(after - before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            "tests left files in the repository (make them write into a temporary directory): "
            + ", ".join(left[:10])
            + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        )
        if reporter is not None:
            reporter.write_sep("=", message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
