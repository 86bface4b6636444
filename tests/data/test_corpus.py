from __future__ import annotations

from pathlib import Path

import pytest

from forge.data import corpus
from forge.data.corpus import (
    DEFAULT_EXCLUDE,
    read_text_files,
    split_of,
    stdlib_dir,
    stdlib_source_files,
)


def _relative(paths: list[Path], root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in paths]


def test_stdlib_dir_holds_the_standard_library() -> None:
    root = stdlib_dir()
    assert (root / "os.py").is_file()
    assert (root / "json" / "__init__.py").is_file()


def test_splits_are_disjoint_sorted_and_cover_the_filtered_files() -> None:
    root = stdlib_dir()
    train = _relative(stdlib_source_files("train"), root)
    evaluation = _relative(stdlib_source_files("eval"), root)
    expected = {
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not set(DEFAULT_EXCLUDE) & set(p.relative_to(root).parts)
    }
    assert train == sorted(train) and evaluation == sorted(evaluation)
    assert not set(train) & set(evaluation)
    assert set(train) | set(evaluation) == expected
    assert len(evaluation) > 0 and len(train) > 10 * len(evaluation)
    assert all(not {"test", "idlelib", "__pycache__"} & set(Path(p).parts) for p in train)


def test_split_depends_only_on_the_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"pkg{i % 3}/mod_{i}.py" for i in range(40)]

    def splits_of(root: Path, files: list[str]) -> dict[str, str]:
        for name in files:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text("x = 1\n")
        monkeypatch.setattr(corpus, "stdlib_dir", lambda: root)
        result = {}
        for split in ("train", "eval"):
            for path in stdlib_source_files(split, eval_fraction=0.5):
                result[path.relative_to(root).as_posix()] = split
        return result

    small = splits_of(tmp_path / "a", names[:15])
    large = splits_of(tmp_path / "b", names)
    assert set(small.values()) == {"train", "eval"}
    assert all(large[name] == split for name, split in small.items())
    assert all(split_of(name, 0.5) == split for name, split in large.items())


def test_split_assignment_is_pinned_across_versions() -> None:
    # a regression guard: changing the hash would silently move files between splits
    assert split_of("os.py", 0.5) == "train"
    assert split_of("json/__init__.py", 0.5) == "train"
    assert split_of("typing.py", 0.5) == "eval"
    assert split_of("re/_parser.py", 0.5) == "eval"


def test_max_files_is_a_deterministic_subset_of_the_split() -> None:
    full = stdlib_source_files("train")
    subset = stdlib_source_files("train", max_files=25)
    assert subset == stdlib_source_files("train", max_files=25)
    assert len(subset) == 25 and subset == sorted(subset)
    assert set(subset) <= set(full)
    assert len({p.parent for p in subset}) > 1  # spread over the tree, not the first 25 names
    assert stdlib_source_files("train", max_files=10**6) == full


def test_custom_exclude() -> None:
    root = stdlib_dir()
    files = _relative(stdlib_source_files("train", exclude=(*DEFAULT_EXCLUDE, "json")), root)
    assert files and not any(p.startswith("json/") for p in files)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "valid"}, "split must be one of"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"max_files": 0}, "max_files"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stdlib_source_files(**kwargs)


def test_read_text_files_replaces_undecodable_bytes(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("é = 1\n", encoding="utf-8")
    bad.write_bytes(b"x = '\xff'\n")
    assert read_text_files([good, str(bad)]) == ["é = 1\n", "x = '\ufffd'\n"]
