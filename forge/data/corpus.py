"""The default corpus: the Python source files of the running interpreter's standard library.

Files are split into train and eval by a stable hash of their path relative to the stdlib
root, so a file's split never depends on which other files exist, on the machine, or on
Python's per-process hash seed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")
DEFAULT_EXCLUDE = (
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
)


def stdlib_dir() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stable_fraction(key: str, salt: str = "") -> float:
    """A number in [0, 1) derived from ``key`` alone, the same on every machine and run."""
    digest = hashlib.sha256(f"{salt}{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(relative_path: str, eval_fraction: float = 0.05) -> str:
    """The split ("train" or "eval") a file belongs to, from its posix relative path only."""
    return "eval" if stable_fraction(relative_path, "split:") < eval_fraction else "train"


def stdlib_source_files(
    split: str = "train",
    *,
    eval_fraction: float = 0.05,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    max_files: int | None = None,
) -> list[Path]:
    """All ``*.py`` files of the standard library in ``split``, sorted by relative path.

    ``exclude`` names directories (or file names) skipped wherever they occur in a relative
    path. ``max_files`` keeps a deterministic, evenly spread subset of the split (chosen by
    a stable hash, then sorted by path again), so small runs still see varied code.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (got {split!r})")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(
            f"eval_fraction must be in [0, 1) (got {eval_fraction!r}); 0.05 keeps 5% for eval"
        )
    _check_max_files(max_files)
    root = stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist")
    skip = set(exclude)
    selected: list[tuple[str, Path]] = []
    for directory, subdirs, filenames in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skip]  # never walk into site-packages
        base = Path(directory)
        for name in filenames:
            if not name.endswith(".py") or name in skip:
                continue
            key = (base / name).relative_to(root).as_posix()
            if split_of(key, eval_fraction) == split:
                selected.append((key, base / name))
    selected.sort()
    if max_files is not None and max_files < len(selected):
        chosen = sorted(selected, key=lambda item: stable_fraction(item[0], "subset:"))
        selected = sorted(chosen[:max_files])
    logger.debug("stdlib %s split: %d files under %s", split, len(selected), root)
    return [path for _, path in selected]


def read_text_files(paths: Iterable[str | Path]) -> list[str]:
    """The contents of ``paths`` decoded as UTF-8; undecodable bytes become U+FFFD."""
    return [Path(path).read_text(encoding="utf-8", errors="replace") for path in paths]


def limit_files(files: Sequence[str | Path], max_files: int | None) -> list[Path]:
    """``files`` as paths, cut to the first ``max_files``; each must be an existing file."""
    _check_max_files(max_files)
    if isinstance(files, (str, Path)):
        raise ValueError("files must be a list of paths, not a single path")
    paths = [Path(f) for f in files]
    if max_files is not None:
        paths = paths[:max_files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"files: {len(missing)} path(s) are not files, e.g. {missing[0]!r}")
    return paths


def _check_max_files(max_files: int | None) -> None:
    if max_files is not None and (
        isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 1
    ):
        raise ValueError(
            f"max_files must be a positive integer or None for all files (got {max_files!r})"
        )
