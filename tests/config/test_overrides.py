"""`--set key.path=value` overrides."""

from __future__ import annotations

import pytest

from forge.config import ConfigError, load_config, parse_config
from forge.config.overrides import split_key_path

CONFIG = """\
.trainer_args: &trainer_args
  size: 1
  name: small
trainer:
  args: !singleton:./helpers.py:Thing
    <<: *trainer_args
  other: *trainer_args
layers: [1, 2, 3]
lr: 1e-3
"""


def test_without_overrides_text_is_rendered_text(config_project):
    config = load_config(config_project(CONFIG), "train")
    assert config.text == CONFIG


def test_scalar_override(config_project):
    config = load_config(config_project(CONFIG), "train", overrides=["lr=5e-4", "layers.1=20"])
    built = config.build(["lr", "layers"])
    assert built == {"lr": 0.0005, "layers": [1, 20, 3]}


def test_override_through_alias_changes_every_sharer(config_project):
    config = load_config(config_project(CONFIG), "train", overrides=["trainer.other.size=9"])
    trainer = config.build("trainer")
    assert trainer["other"] == {"size": 9, "name": "small"}
    assert trainer["args"].size == 9


def test_override_through_merge_key_and_hidden_key(config_project):
    project = config_project(CONFIG)
    config = load_config(project, "train", overrides=["trainer.args.name=big"])
    assert config.build("trainer")["args"].name == "big"
    config = load_config(project, "train", overrides=[".trainer_args.name=huge"])
    assert config.build("trainer")["args"].name == "huge"


def test_override_with_tagged_and_flow_values(config_project):
    config = load_config(
        config_project(CONFIG),
        "train",
        overrides=["trainer.other=!singleton:./helpers.py:Pair [1, 2]", "layers=[7]"],
    )
    built = config.build(["trainer", "layers"])
    assert (built["trainer"]["other"].left, built["trainer"]["other"].right) == (1, 2)
    assert built["layers"] == [7]


def test_text_is_reserialized_and_parses_back(config_project):
    project = config_project(CONFIG)
    config = load_config(project, "train", overrides=["trainer.args.size=4"])
    assert config.text != CONFIG
    assert "size: 4" in config.text and "!singleton:./helpers.py:Thing" in config.text
    again = parse_config(config.text, project=project)
    assert again.text == config.text  # nothing left to override
    first, second = config.build(config.public_targets), again.build(again.public_targets)
    assert vars(first["trainer"]["args"]) == vars(second["trainer"]["args"])
    assert first["trainer"]["other"] == second["trainer"]["other"]
    assert first["layers"] == second["layers"] and first["lr"] == second["lr"]


def test_unknown_path_is_an_error_with_suggestions(config_project):
    project = config_project(CONFIG)
    with pytest.raises(ConfigError) as info:
        load_config(
            project, "train", overrides=["trainer.args.siz=2", "layers.5=1", "lr.x=1", "nope"]
        )
    problems = info.value.problems
    assert len(problems) == 4
    unknown = problems[0]
    assert unknown.key_path == "trainer.args.siz"
    assert "unknown key 'siz' in trainer.args" in unknown.message
    assert "did you mean 'size'?" in unknown.message
    assert "--set trainer.args.siz=2" in unknown.message
    assert "size" in unknown.hint and "name" in unknown.hint
    assert "not an index" in problems[1].message
    assert "has no key 'x'" in problems[2].message
    assert "expected KEY.PATH=VALUE" in problems[3].message


def test_override_problem_is_located_at_the_flag(config_project):
    config = load_config(
        config_project(CONFIG), "train", overrides=["trainer.args=!singleton:math:nope"]
    )
    (problem,) = config.check()
    assert problem.file is None and problem.key_path == "trainer.args"
    assert problem.context == "--set trainer.args=!singleton:math:nope"


@pytest.mark.parametrize(
    ("path", "segments"),
    [("a.b.0", ["a", "b", "0"]), (".hidden.x", [".hidden", "x"]), ("a..b", ["a", ".b"])],
)
def test_split_key_path(path, segments):
    assert split_key_path(path) == segments


def test_set_adds_a_keyword_the_callable_takes(config_project):
    project = config_project(CONFIG)
    config = load_config(project, "train", overrides=["trainer.args.scale=2.5"])
    assert config.check() == []
    assert "scale: 2.5" in config.text
    assert config.build("trainer")["args"].scale == 2.5


def test_set_adds_a_keyword_to_a_callable_with_kwargs(config_project):
    project = config_project("c: !call:./helpers.py:collect {_args: [1]}\n")
    config = load_config(project, "train", overrides=["c.anything=3"])
    assert config.build("c") == ((1,), {"anything": 3})


def test_set_refuses_a_keyword_the_callable_does_not_take(config_project):
    project = config_project(CONFIG)
    with pytest.raises(ConfigError) as info:
        load_config(project, "train", overrides=["trainer.args.scal=2.5"])
    (problem,) = info.value.problems
    assert problem.key_path == "trainer.args.scal"
    assert "`./helpers.py:Thing` takes no keyword 'scal'; did you mean 'scale'?" in problem.message
    assert problem.hint == "keywords it takes: size, name, scale"


def test_set_does_not_add_keys_to_plain_mappings_or_deeper_paths(config_project):
    project = config_project(CONFIG)
    with pytest.raises(ConfigError) as info:
        load_config(project, "train", overrides=["trainer.extra=1", "trainer.args.new.x=1"])
    messages = [p.message for p in info.value.problems]
    assert messages[0].startswith("unknown key 'extra' in trainer")
    assert messages[1].startswith("unknown key 'new' in trainer.args")


def test_set_gives_a_keyword_the_callable_takes_as_a_mapping_the_path_fills(config_project):
    """HF's dict arguments set key by key (``--set trainer.args.fsdp_config.replicate_size=2``
    where the config has no ``fsdp_config``): several flags fill one new mapping."""
    project = config_project(CONFIG)
    overrides = ["trainer.args.scale.factor=2", "trainer.args.scale.inner.depth=3"]
    config = load_config(project, "train", overrides=overrides)
    assert config.build("trainer")["args"].scale == {"factor": 2, "inner": {"depth": 3}}
    with pytest.raises(ConfigError) as info:
        load_config(project, "train", overrides=["trainer.args.scal.factor=2"])
    (problem,) = info.value.problems
    assert "takes no keyword 'scal'; did you mean 'scale'?" in problem.message
    assert problem.key_path == "trainer.args.scal"


def test_an_added_keyword_is_checked_and_located_at_the_flag(config_project):
    project = config_project("x: !call:./helpers.py:Thing {size: 1}\n")
    config = load_config(project, "train", overrides=["x.scale=!call:math:nope"])
    (problem,) = config.check()
    assert problem.key_path == "x.scale" and "no attribute 'nope'" in problem.message
    assert problem.context == "--set x.scale=!call:math:nope"


@pytest.mark.slow
def test_set_adds_training_arguments_field_through_the_cli():
    from tests.helpers import TINY_LM, run_forge

    result = run_forge(
        "train",
        "train.yaml",
        "-p",
        str(TINY_LM),
        "--set",
        "trainer.args.resume_from_checkpoint=/some/checkpoint-000100",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert "renders and checks" in result.stdout
    typo = run_forge("render", "-p", str(TINY_LM), "--set", "trainer.args.resume_from_checkpont=x")
    assert typo.returncode == 2
    assert "did you mean 'resume_from_checkpoint'" in typo.stderr
