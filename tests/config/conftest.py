"""Small forge projects written into tmp_path."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from forge.config import Project, load_project

HELPERS = """
class Thing:
    def __init__(self, size, name="thing", *, scale=1.0):
        self.size, self.name, self.scale = size, name, scale


class Pair:
    def __init__(self, left, right):
        self.left, self.right = left, right


def collect(*items, **options):
    return items, options
"""

MakeProject = Callable[..., Project]


@pytest.fixture
def make_project(tmp_path: Path) -> MakeProject:
    """`make_project({"templates/configs/train.yaml": "...", ...}, meta="name: x")`.

    Every project gets helpers.py (Thing, Pair, collect) for `./helpers.py:Name` specs.
    File texts are dedented.
    """

    def make(
        files: dict[str, str], meta: str = "name: demo\n", root: Path | None = None
    ) -> Project:
        root = root or tmp_path / "proj"
        root.mkdir(parents=True, exist_ok=True)
        (root / "meta.yaml").write_text(textwrap.dedent(meta))
        (root / "helpers.py").write_text(HELPERS)
        (root / "templates" / "configs").mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return load_project(root)

    return make


@pytest.fixture
def config_project(make_project: MakeProject) -> Callable[[str], Project]:
    """A project whose only config `train.yaml` is the given text."""

    def make(text: str, **kwargs: object) -> Project:
        return make_project({"templates/configs/train.yaml": text}, **kwargs)

    return make
