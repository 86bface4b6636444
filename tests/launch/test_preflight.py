"""The pre-run contract check, in process: what it says about plain PyTorch models and data,
the adapters it sees through, and compute_loss_func."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.cli.new import new_project
from forge.config import ConfigError, load_config, load_project
from forge.launch.preflight import check_training_contract
from forge.launch.worker import build_variables
from tests.cli.test_preflight import PLAIN_DATA, PLAIN_MODEL

TUPLES = "data_collator: &data_collator !singleton:forge.data:TupleCollator {names: [x, y]}"
ADAPTED = "!partial:forge.train:LossAdapter\n    module: !partial:./model.py:Net {hidden: 16}"


def project_with(
    tmp_path: Path, *, model: str, collator: str | None = None, trainer: str = ""
) -> Path:
    """The blank scaffold with PLAIN_MODEL / PLAIN_DATA and the given blocks filled."""
    project = new_project("plain", tmp_path, "blank")
    (project / "model.py").write_text(PLAIN_MODEL)
    (project / "data.py").write_text(PLAIN_DATA)
    config = project / "templates" / "configs" / "train.yaml"
    text = config.read_text()
    text = text.replace("model: &model null", f"model: &model {model}")
    text = text.replace(
        "train_dataset: &train_dataset null",
        "train_dataset: &train_dataset !singleton:./data.py:Blobs {}",
    )
    # the blank scaffold evaluates: the trainer (built by the sanity pass) needs the split
    text = text.replace(
        "eval_dataset: &eval_dataset null",
        "eval_dataset: &eval_dataset !singleton:./data.py:Blobs {n: 32, seed: 1}",
    )
    if collator:
        text += f"\n-- block collator\n{collator}\n-- endblock\n"
    config.write_text(text)
    if trainer:  # a config of its own adds the Trainer argument, as a user would
        (config.parent / "loss.yaml").write_text(
            f"-- extends 'configs/train.yaml'\n-- block trainer\n    == super()\n{trainer}\n"
            "-- endblock\n"
        )
    return project


def problems(project: Path, **defines: str) -> str:
    loaded = load_project(project)
    name = (
        "loss.yaml" if (project / "templates" / "configs" / "loss.yaml").exists() else "train.yaml"
    )
    cfg = load_config(loaded, name, defines)
    variables = build_variables(project / "output" / "run_NNN", loaded, name)
    try:
        check_training_contract(cfg, variables)
    except ConfigError as err:
        return str(err)
    return ""


def test_tuple_items_are_told_the_collator_that_names_them(tmp_path):
    found = problems(project_with(tmp_path, model="!partial:./model.py:Net {hidden: 16}"))
    assert "train_dataset: batches must be dicts of tensors" in found
    assert "a list of 2 (the dataset's items are tuples" in found
    assert "TupleCollator {names: [x, y]}" in found  # forward's argument names


def test_a_forward_returning_its_loss_as_a_tensor_is_told_the_loss_adapter(tmp_path):
    found = problems(
        project_with(tmp_path, model="!partial:./model.py:Net {hidden: 16}", collator=TUPLES)
    )
    assert (
        "Net.forward must return an object with .loss or a dict with 'loss' (got Tensor)" in found
    )
    assert "!partial:forge.train:LossAdapter" in found


def test_the_check_looks_through_the_loss_adapter_at_the_model_it_wraps(tmp_path):
    assert problems(project_with(tmp_path, model=ADAPTED, collator=TUPLES)) == ""
    names = TUPLES.replace("[x, y]", "[inputs, y]")
    found = problems(project_with(tmp_path / "other", model=ADAPTED, collator=names))
    assert "the batches do not fit Net.forward: forward takes no 'inputs'" in found


def test_a_forward_returning_loss_and_logits_as_a_tuple_passes_as_the_trainer_reads_it(tmp_path):
    """The trainer reads a tuple's first element as its loss (HF's rule): the check reads what
    forward returns the same way, instead of refusing a model the trainer trains."""
    project = project_with(tmp_path, model="!partial:./model.py:Net {hidden: 16}", collator=TUPLES)
    model = project / "model.py"
    returns = "return logits if y is None else nn.functional.cross_entropy(logits, y)"
    assert returns in model.read_text()
    model.write_text(
        model.read_text().replace(returns, "return nn.functional.cross_entropy(logits, y), logits")
    )
    assert problems(project) == ""


def test_compute_loss_func_is_checked_against_how_the_trainer_calls_it(tmp_path):
    logits_only = "!partial:torch.nn:Linear {in_features: 4, out_features: 3}"
    fine = "    compute_loss_func: !partial:torch.nn.functional:cross_entropy []"
    names = TUPLES.replace("[x, y]", "[input, labels]")
    assert problems(project_with(tmp_path, model=logits_only, collator=names, trainer=fine)) == ""
    bad = "    compute_loss_func: !partial:math:sqrt []"  # takes one argument
    found = problems(project_with(tmp_path / "bad", model=logits_only, collator=names, trainer=bad))
    assert "the trainer calls this partial as compute_loss_func(outputs, labels)" in found


def test_the_pipeline_trainer_refuses_compute_loss_func_at_its_line(tmp_path):
    loss = "    compute_loss_func: !partial:torch.nn.functional:cross_entropy []"
    project = project_with(tmp_path, model=ADAPTED, collator=TUPLES, trainer=loss)
    found = problems(project, trainer_class="forge.train:PipelineTrainer")
    line = next(
        n
        for n, text in enumerate(
            (project / "templates/configs/loss.yaml").read_text().splitlines(), 1
        )
        if "compute_loss_func:" in text
    )
    assert f"loss.yaml:{line}: trainer.compute_loss_func: the pipeline trainer computes" in found
    assert "give it loss_fn(logits, labels) instead" in found


@pytest.fixture(autouse=True)
def _quiet_cwd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # problems name files relative to the working directory


# ------------------------------------------------------------------ LoRA targets of a plain module

OWN_PEFT = """\
-- extends 'configs/lm.yaml'
-- block trainer
    == super()
    peft_config: !singleton:peft:LoraConfig
        r: 4
-- endblock
"""
LIBRARY_PEFT = """\
-- extends 'configs/lm.yaml'
-- import 'trainers/lora.yaml' as lora
-- block trainer
    == super()
== lora.peft_config()
-- endblock
"""


@pytest.mark.parametrize("config", ["own", "library"])
def test_lora_targets_a_plain_module_needs_are_asked_for_where_the_config_sets_them(
    tmp_path, capsys, config
):
    """A module of no known style must name its LoRA targets: a peft_config of the user's own
    is told to add target_modules (no -D reads it), the library's macro -D lora_target_modules."""
    from forge.cli import main
    from tests.plain_project import write_project

    root = write_project(tmp_path / "plain")
    (root / "templates" / "configs" / "own.yaml").write_text(OWN_PEFT)
    (root / "templates" / "configs" / "library.yaml").write_text(LIBRARY_PEFT)
    assert main(["train", config, "-p", str(root), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "forge cannot tell which layers of a model.py:TinyLM to adapt" in err  # its file
    assert "embed, head" in err and "Traceback" not in err
    if config == "own":
        assert "own.yaml:4:" in err  # the peft_config line: it has no target_modules
        assert "add target_modules: [embed, head] to trainer.peft_config" in err
        assert "-D" not in err
    else:
        assert "trainers/lora.yaml:" in err  # the line that writes target_modules
        assert "-D lora_target_modules='[embed, head]'" in err


def test_a_builder_that_loads_weights_on_the_meta_device_is_not_warned_of_per_tensor():
    """The dry run builds models on the meta device, where a builder's load_state_dict is a
    no-op that torch warns of once per tensor."""
    import warnings

    import torch
    from torch import nn

    from forge.launch.preflight import on_meta_device

    weights = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with on_meta_device():
            model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            model.load_state_dict(weights)
        warnings.warn("after the build", UserWarning, stacklevel=1)  # others still reach the user
    assert model[0].weight.device == torch.device("meta")
    assert [str(w.message) for w in caught] == ["after the build"]
