"""A project's Python files import each other by name, as the script of `forge code` does."""

from __future__ import annotations

from forge.config import load_config
from tests.helpers import run_forge

SEQDATA = """
class Vocab:
    def __init__(self, size=8):
        self.size = size


def pad_collate(rows, pad=0):
    width = max(len(row) for row in rows)
    return [row + [pad] * (width - len(row)) for row in rows]
"""

SEQMODEL = """
import json  # the standard library's, not the project's json.py

from lib.sizes import HIDDEN
from seqdata import Vocab, pad_collate


class GRUClassifier:
    def __init__(self, vocab):
        assert isinstance(vocab, Vocab), type(vocab)  # one Vocab class, however it came
        self.width = len(pad_collate([[1], [1, 2, 3]])[0])
        self.hidden = HIDDEN
        self.json = json.__name__
"""

CONFIG = """\
vocab: &vocab !singleton:./seqdata.py:Vocab {}
model: !singleton:./seqmodel.py:GRUClassifier {vocab: *vocab}
"""


def write_project(make_project, **extra: str):
    files = {
        "seqdata.py": SEQDATA,
        "seqmodel.py": SEQMODEL,
        "lib/__init__.py": "",
        "lib/sizes.py": "HIDDEN = 16\n",
        "templates/configs/train.yaml": CONFIG,
        **extra,
    }
    return make_project(files)


def test_a_project_file_imports_another_by_name_and_both_are_one_module(make_project):
    project = write_project(
        make_project, **{"json.py": "raise RuntimeError('the project json.py was imported')\n"}
    )
    config = load_config(project, "train")
    assert config.check() == []
    model = config.build("model")  # was: ModuleNotFoundError: No module named 'seqdata'
    assert (model.width, model.hidden, model.json) == (3, 16, "json")


def test_each_project_imports_its_own_files(make_project, tmp_path):
    first = write_project(make_project, **{"lib/sizes.py": "HIDDEN = 16\n"})
    assert load_config(first, "train").build("model").hidden == 16
    second = make_project(
        {
            "seqdata.py": SEQDATA,
            "seqmodel.py": SEQMODEL,
            "lib/__init__.py": "",
            "lib/sizes.py": "HIDDEN = 32\n",
            "templates/configs/train.yaml": CONFIG,
        },
        root=tmp_path / "second",
    )
    assert load_config(second, "train").build("model").hidden == 32


def test_forge_build_imports_the_project_files(make_project, tmp_path):
    report = (
        "from seqdata import Vocab\nfrom seqmodel import GRUClassifier\n\n\n"
        "def width():\n    return GRUClassifier(Vocab()).width\n"
    )
    config = CONFIG + "width: !call:./report.py:width []\n"
    project = write_project(make_project, **{"report.py": report})
    (project.root / "templates/configs/train.yaml").write_text(config)
    # not from the project directory: ``python -m`` would put it on sys.path
    built = run_forge("build", "train", "-p", str(project.root), "--target", "width", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == "3"
