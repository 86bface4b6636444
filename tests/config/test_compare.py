"""forge/config/compare.py: the keys two rendered configs differ at, as the nodes of one job
compare them (forge/launch/endpoint.py)."""

from __future__ import annotations

from pathlib import Path

from forge.config import load_config, load_project
from forge.config.compare import config_differences, flat_keys

TINY_LM = Path(__file__).parents[2] / "projects" / "tiny_lm"

RENDERED = """\
.args: &args !singleton:forge.train:TrainingArguments
  max_steps: 10
  learning_rate: 1e-3
trainer: !singleton:forge.train:Trainer
  args: *args
  model: !partial:torch.nn:Linear [4, 2]
"""


def test_keys_are_paths_with_their_tags_and_later_keys_win():
    flat = flat_keys(RENDERED + "trainer:\n  args: {max_steps: 20}\n")
    assert flat["trainer.args.max_steps"] == "20"  # the later `trainer` replaces the first
    assert "trainer.model" not in flat
    flat = flat_keys(RENDERED)
    assert flat["trainer"] == "!singleton:forge.train:Trainer"
    assert flat["trainer.args"] == "!singleton:forge.train:TrainingArguments"
    assert flat["trainer.args.learning_rate"] == "0.001"  # YAML 1.2 floats, as forge reads
    assert flat["trainer.model"] == "!partial:torch.nn:Linear"
    assert flat["trainer.model[1]"] == "2"


def test_the_same_values_laid_out_otherwise_do_not_differ():
    flow = RENDERED.replace(
        "\n  max_steps: 10\n  learning_rate: 1e-3\n", " {max_steps: 10, learning_rate: 0.001}\n"
    )
    assert flow != RENDERED
    assert config_differences(RENDERED, flow) == []
    assert config_differences(RENDERED, RENDERED + "# a comment\n") == []


def test_differences_name_each_key_with_both_values_in_the_first_configs_order():
    other = RENDERED.replace("max_steps: 10", "max_steps: 12").replace(
        "!partial:torch.nn:Linear [4, 2]", "!partial:torch.nn:Bilinear [4, 2, 1]"
    )
    differences = config_differences(RENDERED, other)
    assert differences == [
        (".args.max_steps", "10", "12"),
        ("trainer.args.max_steps", "10", "12"),
        ("trainer.model", "!partial:torch.nn:Linear", "!partial:torch.nn:Bilinear"),
        ("trainer.model[2]", None, "1"),
    ]


def test_a_define_and_a_set_on_tiny_lm_are_named_by_their_keys():
    project = load_project(TINY_LM)
    base = load_config(project, "train", variables={}, overrides=[]).text
    changed = load_config(
        project, "train", variables={"max_steps": 7}, overrides=["trainer.args.seed=3"]
    ).text
    keys = {key for key, _, _ in config_differences(base, changed)}
    assert {"trainer.args.max_steps", "trainer.args.seed"} <= keys
    assert all(key.endswith(("max_steps", "seed")) for key in keys), keys
    other = load_config(project, "pipeline", variables={}, overrides=[]).text
    keys = [key for key, _, _ in config_differences(base, other)]
    assert "meta.config" in keys and "trainer" in keys
