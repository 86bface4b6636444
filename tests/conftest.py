"""Suite-wide checks: no test may leave a file in the repository. And the order in which the
test files are handed out to several test processes.

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


# ---------------------------------------------------------------- the longest files first
#
# With several test processes (``-n 2 --dist loadfile``, as `make test` runs) each file goes
# whole to one process, in collection order; pytest-xdist would put the files with the most
# tests first. A long file handed out last runs alone while the other process idles: the kill
# matrix (tests/reliability/test_kills.py, about 75 minutes of one process in `make test-all`)
# once started at three quarters of the run. Measured totals, longest first (seconds of one
# process under `-n 2`: make test-all, then the default suite beside a make test-all, commands
# forked by run_forge); the other files keep their order.
LONGEST_FIRST = (
    "reliability/test_kills.py",  # 4466 / 158
    "reliability/test_preemption.py",  # 2214 / 93
    "integration/test_pipeline_cli.py",  # 1407 / 70
    "train/test_fsdp.py",  # 1027 / 127
    "train/test_length_grouped_resume.py",  # 977 / 29
    "integration/test_stream_resume.py",  # 747 / 0
    "reliability/test_job_lifetime.py",  # 571 / 107
    "integration/test_multinode.py",  # 483 / 87
    "integration/test_launched_job.py",  # - / 200
    "reliability/test_concurrency.py",  # - / 140
    "reliability/test_hostile.py",  # - / 124
    "train/test_packing.py",  # - / 115
    "reliability/test_corruption.py",  # - / 110
    "data/test_loader.py",  # - / 109
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = REPO / "tests"
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def place(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(tests).as_posix(), len(rank))
        except ValueError:  # a test outside tests/
            return len(rank)

    items.sort(key=place)  # stable: within a file, and among the other files, the order is kept
