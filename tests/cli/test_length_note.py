"""`forge train` says which of max_steps and num_train_epochs decides the length, only where
the config set both."""

from __future__ import annotations

from forge.cli import main
from forge.cli.new import new_config, new_project
from forge.config import load_config, load_project
from forge.launch.length_note import length_note
from tests.helpers import TINY_LM

EPOCHS = "-- block trainer_args\n    == super()\n    num_train_epochs: 1\n-- endblock\n"


def classifier_child(tmp_path, text: str = EPOCHS):
    project = load_project(new_project("vis", tmp_path, "classifier"))
    path = new_config(project, "cnn", "train")
    path.write_text(path.read_text() + text)
    return project, path


def line_of(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_epochs_of_a_child_are_said_to_lose_to_the_parents_max_steps(tmp_path):
    project, path = classifier_child(tmp_path)
    note = length_note(load_config(project, "cnn"))
    train = project.configs_dir / "train.yaml"
    assert note.startswith(
        f"max_steps: 300 ({train}:{line_of(train, 'max_steps:')}) overrides "
        f"num_train_epochs: 1 ({path}:{line_of(path, 'num_train_epochs')})"
    )
    assert "set max_steps: -1" in note


def test_no_note_where_the_library_set_one_of_them(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: port\n")
    (tmp_path / "templates" / "configs" / "c.yaml").write_text("-- extends 'base.yaml'\n" + EPOCHS)
    assert length_note(load_config(load_project(tmp_path), "c")) is None  # an HF port
    assert length_note(load_config(load_project(TINY_LM), "train")) is None  # steps only


def test_epochs_given_by_define_or_set_are_said_to_lose(tmp_path):
    by_define = length_note(load_config(load_project(TINY_LM), "train", {"num_train_epochs": 2}))
    assert by_define.startswith("max_steps: 500 (") and "num_train_epochs: 2 (" in by_define
    by_set = length_note(
        load_config(load_project(TINY_LM), "train", overrides=["trainer.args.num_train_epochs=2"])
    )
    assert "num_train_epochs: 2 (--set trainer.args.num_train_epochs=2)" in by_set
    ended = length_note(
        load_config(load_project(TINY_LM), "train", {"num_train_epochs": 2, "max_steps": -1})
    )
    assert ended is None


def test_dry_run_prints_which_wins(tmp_path, monkeypatch, capsys):
    classifier_child(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "cnn", "-p", "vis", "--dry-run"]) == 0
    shown = capsys.readouterr().out
    assert "  max_steps: 300 (vis/templates/configs/train.yaml:" in shown
    assert "overrides num_train_epochs: 1 (vis/templates/configs/cnn.yaml:7)" in shown
