"""`forge new` and `forge new-config` through the real entry point: scaffolds that train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forge.cli.new import new_config, new_project
from forge.config import load_config, load_project
from tests.cli.small_lm import SMALL_LM, defines
from tests.helpers import TINY_LM, run_forge


def logged_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m["loss"] for m in map(json.loads, lines) if "loss" in m]


def test_classifier_scaffold_trains_and_its_loss_falls(tmp_path):
    created = run_forge("new", "demo_cls", "--from", "classifier", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    project = tmp_path / "demo_cls"
    assert created.stdout.strip() == str(project)
    for name in ("meta.yaml", "templates/configs/train.yaml", "model.py", "data.py"):
        assert (project / name).is_file(), name
    trained = run_forge("train", "-p", "demo_cls", "-D", "max_steps=50", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    run_dir = Path(trained.stdout.splitlines()[0])
    losses = logged_losses(run_dir)
    assert len(losses) == 5
    assert losses[-1] < 0.5 * losses[0]
    assert (run_dir / "checkpoints" / "checkpoint-000050" / "manifest.json").is_file()
    # HF's end-of-training summary: in the log, metrics.jsonl and run.json; and no noise: no
    # tokens/s for a model without tokens, no huggingface_hub line at every checkpoint
    assert "trained to step 50 | train_runtime " in trained.stderr
    assert "tokens_per_second" not in trained.stderr
    assert "successfully saved" not in trained.stderr
    summary = json.loads((run_dir / "run.json").read_text())["train_summary"]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary == last and summary["step"] == 50
    runtime = summary["train_runtime"]  # rounded to 4 decimals: the rate is not
    samples = summary["train_samples_per_second"] * runtime
    assert samples == pytest.approx(
        50 * 64, rel=1e-3 + 0.5e-4 / runtime
    )  # 50 steps of the scaffold's 64 items


def test_tiny_lm_scaffold_trains_a_few_steps(tmp_path):
    created = run_forge("new", "lm", "-p", str(tmp_path))
    assert created.returncode == 0, created.stderr
    training = {
        "batch_size": 8,
        "max_steps": 20,
        "logging_steps": 5,
        "eval_steps": 20,
        "save_steps": 20,
        "warmup_steps": 1,
        "learning_rate": 0.01,
    }
    trained = run_forge("train", "-p", str(tmp_path / "lm"), *defines(SMALL_LM | training))
    assert trained.returncode == 0, trained.stderr
    losses = logged_losses(Path(trained.stdout.splitlines()[0]))
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 0.3


def test_blank_scaffold_renders_and_checks(tmp_path):
    created = run_forge("new", "scratch", "--from", "blank", "-p", str(tmp_path))
    assert created.returncode == 0, created.stderr
    project = tmp_path / "scratch"
    assert "name: scratch" in (project / "meta.yaml").read_text()
    listed = run_forge("ls", "-p", str(project), "--check")
    assert listed.returncode == 0, listed.stderr
    assert "train.yaml*  ok" in listed.stdout
    rendered = run_forge("render", "-p", str(project))
    assert rendered.returncode == 0, rendered.stderr
    assert "model: &model null" in rendered.stdout and '"scratch"' in rendered.stdout


def test_new_refuses_a_non_empty_target_and_accepts_an_empty_one(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    refused = run_forge("new", "taken", "-p", str(tmp_path))
    assert refused.returncode == 2
    assert "already exists and is not empty" in refused.stderr
    assert "Traceback" not in refused.stderr and refused.stdout == ""
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    accepted = run_forge("new", "empty", "--from", "blank", "-p", str(tmp_path))
    assert accepted.returncode == 0, accepted.stderr
    assert (tmp_path / "empty" / "meta.yaml").is_file()


@pytest.mark.parametrize("name", ["../escape", "a b", ".hidden"])
def test_new_refuses_a_bad_name(tmp_path, name):
    result = run_forge("new", name, "--from", "blank", "-p", str(tmp_path / "parent"))
    assert result.returncode == 2
    assert "project name" in result.stderr
    assert not (tmp_path / "parent").exists() and not (tmp_path / "escape").exists()


def test_new_unknown_scaffold_lists_the_choices(tmp_path):
    result = run_forge("new", "x", "--from", "gpt5", "-p", str(tmp_path))
    assert result.returncode == 2
    assert "classifier" in result.stderr and "blank" in result.stderr


def test_new_config_extends_a_project_config(tmp_path):
    assert run_forge("new", "cls", "--from", "classifier", "-p", str(tmp_path)).returncode == 0
    project = str(tmp_path / "cls")
    added = run_forge("new-config", "wide", "--extends", "train", "-p", project)
    assert added.returncode == 0, added.stderr
    path = tmp_path / "cls" / "templates" / "configs" / "wide.yaml"
    assert added.stdout.strip() == str(path)
    assert "-- extends 'configs/train.yaml'" in path.read_text()
    rendered = run_forge("render", "wide", "-p", project, "-D", "hidden_size=128")
    assert rendered.returncode == 0, rendered.stderr
    assert "hidden_size: 128" in rendered.stdout and 'config: "wide"' in rendered.stdout
    again = run_forge("new-config", "wide", "--extends", "train", "-p", project)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_new_config_extends_a_library_template(tmp_path):
    assert run_forge("new", "b", "--from", "blank", "-p", str(tmp_path)).returncode == 0
    project = str(tmp_path / "b")
    added = run_forge("new-config", "lm", "--extends", "projects/causal_lm.yaml", "-p", project)
    assert added.returncode == 0, added.stderr
    listed = run_forge("ls", "-p", project, "--check")
    assert listed.returncode == 0, listed.stderr
    assert "lm.yaml" in listed.stdout


def test_new_config_unknown_parent_exits_2_listing_configs(tmp_path):
    assert run_forge("new", "b", "--from", "blank", "-p", str(tmp_path)).returncode == 0
    result = run_forge("new-config", "x", "--extends", "trian", "-p", str(tmp_path / "b"))
    assert result.returncode == 2
    assert "train.yaml" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "b" / "templates" / "configs" / "x.yaml").exists()


OVERRIDE = "-- block trainer_args\n    == super()\n    max_steps: 77\n-- endblock\n"


@pytest.mark.parametrize("kind", ["classifier", "tiny_lm", "blank"])
def test_a_new_config_overrides_trainer_args_of_every_scaffold(tmp_path, kind):
    project = load_project(new_project("vis", tmp_path, kind))
    path = new_config(project, "cnn", "train")
    path.write_text(path.read_text() + OVERRIDE)
    line = len(path.read_text().splitlines()) - 1
    resolved = load_config(project, "cnn").resolved_text()
    assert f"  max_steps: 77  # {path}:{line}\n" in resolved
    assert resolved.count("max_steps:") == 1


def test_the_child_override_of_the_issue_through_the_cli(tmp_path):
    """`forge new vis --from classifier`, `forge new-config cnn --extends train`, a
    trainer_args override in cnn.yaml: render --resolved and vars show the child's value."""
    assert run_forge("new", "vis", "--from", "classifier", cwd=tmp_path).returncode == 0
    assert (
        run_forge("new-config", "cnn", "--extends", "train", "-p", "vis", cwd=tmp_path).returncode
        == 0
    )
    cnn = tmp_path / "vis" / "templates" / "configs" / "cnn.yaml"
    cnn.write_text(cnn.read_text() + OVERRIDE.replace("77", "{{ max_steps | default(77) }}"))
    rendered = run_forge("render", "cnn", "-p", "vis", "--resolved", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    assert "  max_steps: 77  # vis/templates/configs/cnn.yaml:7" in rendered.stdout
    shown = run_forge("vars", "cnn", "-p", "vis", "-D", "max_steps=5", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines()]
    assert ["max_steps", "77", "vis/templates/configs/cnn.yaml:7"] in rows
    trained = run_forge(
        "render", "cnn", "-p", "vis", "--resolved", "-D", "max_steps=5", cwd=tmp_path
    )
    assert "  max_steps: 5  # vis/templates/configs/cnn.yaml:7" in trained.stdout


def test_tiny_lm_project_configs_work_in_a_tiny_lm_scaffold(tmp_path):
    """accel.yaml and pipeline.yaml of projects/tiny_lm, copied into a `forge new` project,
    keep the scaffold's training arguments and add their own."""
    root = new_project("lm", tmp_path, "tiny_lm")
    for name in ("accel.yaml", "pipeline.yaml"):
        source = TINY_LM / "templates" / "configs" / name
        (root / "templates" / "configs" / name).write_text(source.read_text())
    project = load_project(root)
    for name, spec in (
        ("accel", "forge.train:AccelTrainingArguments"),
        ("pipeline", "forge.train:PipelineTrainingArguments"),
    ):
        args = load_config(project, name).targets["trainer"].kwargs["args"]
        assert args.spec == spec
        assert (args.kwargs["max_steps"], args.kwargs["logging_steps"]) == (500, 25)
    pipeline = load_config(project, "pipeline").targets["trainer"].kwargs["args"].kwargs
    assert pipeline["pipeline_schedule"] == "1f1b"
