"""One model, one answer: whichever way a checkpoint's weights are written (one stage through
save_pretrained or plain safetensors, pipeline stage shards, an Accelerate-gathered state dict),
a transformers model gets the same config.json beside weights from_pretrained loads in full,
and any other module (a wrapper carrying a ``config`` attribute too) gets none."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from checkpoint_helpers import LMWrapper, models_of_every_kind, tiny_gpt2
from torch import nn
from transformers import AutoConfig, GPT2LMHeadModel

from forge.checkpoint import (
    CheckpointWriter,
    ModelWeights,
    load_model_weights,
    read_manifest,
    stage_weights_name,
    validate_checkpoint,
)
from forge.checkpoint.hf import expected_weights, hf_model_in, is_hf_model

MODELS = models_of_every_kind()
WAYS = ["one_stage", "gathered", "two_stages"]


def one_name_per_tensor(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the second name of a tied tensor (as the stages write it)."""
    seen, kept = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept[name] = tensor.detach()
    return kept


def write(model: nn.Module, root, way: str):
    """A checkpoint of ``model``'s weights, written the way one of the trainers writes them."""
    gathered = {k: v.clone() for k, v in model.state_dict().items()}
    weights = ModelWeights(model, state_fn=(lambda: gathered) if way == "gathered" else None)
    with CheckpointWriter(root, 1) as writer:
        if way == "two_stages":
            state = one_name_per_tensor(model)
            names = list(state)
            halves = [names[: len(names) // 2], names[len(names) // 2 :]]
            files = [stage_weights_name(k, 2) for k in range(2)]
            for file, half in zip(files, halves, strict=True):
                weights.write(writer, {n: state[n] for n in half}, file)
            writer.index_weights(files)
        else:
            weights.write(writer, weights.state_dict(), None)
    return writer.final_path


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_way_of_writing_a_model_gives_one_answer(kind, tmp_path):
    model = MODELS[kind]()
    # each way its own (identical) model, as each trainer builds one: no way sees another's
    checkpoints = {way: write(MODELS[kind](), tmp_path / way, way) for way in WAYS}
    hf = is_hf_model(model)
    for way, path in checkpoints.items():
        assert validate_checkpoint(path) == [], way
        assert (path / "config.json").is_file() == hf, way
        assert not (path / "generation_config.json").exists() or hf, way
        fresh = MODELS[kind]()
        torch.nn.init.zeros_(next(fresh.parameters()))
        load_model_weights(fresh, path)  # forge loads each by the model's own names
        for name, tensor in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), (way, name)
    if hf:
        configs = {w: json.loads((p / "config.json").read_text()) for w, p in checkpoints.items()}
        assert configs["two_stages"] == configs["one_stage"] == configs["gathered"]
        assert configs["one_stage"]["architectures"] == [type(model).__name__]
        for way, path in checkpoints.items():
            loaded, info = type(model).from_pretrained(path, output_loading_info=True)
            assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
            for name, tensor in model.state_dict().items():
                assert torch.equal(loaded.state_dict()[name], tensor), (way, name)
    # the manifest says what the model is, and where a transformers model sits inside it
    records = {way: read_manifest(path).extra["model"] for way, path in checkpoints.items()}
    assert len({json.dumps(r, sort_keys=True) for r in records.values()}) == 1, records
    record = records["one_stage"]
    assert record["class"].endswith(type(model).__qualname__)
    assert record.get("hf_submodule") == ("lm" if isinstance(model, LMWrapper) else None)


def test_a_config_json_beside_names_of_another_class_is_removed_with_a_warning(tmp_path, caplog):
    wrapper = LMWrapper(tiny_gpt2())
    with CheckpointWriter(tmp_path, 4, trainer="pipeline") as writer:
        wrapper.config.save_pretrained(writer.path)  # what the stages wrote for a wrapper
        state = one_name_per_tensor(wrapper)
        writer.save_safetensors(stage_weights_name(0, 1), state)
        writer.index_weights([stage_weights_name(0, 1)])
    path = writer.final_path
    assert not (path / "config.json").exists()
    assert validate_checkpoint(path) == []
    message = caplog.text
    assert "checkpoint-000004 is not a Hugging Face model directory (config.json removed)" in (
        message
    )
    assert "not GPT2LMHeadModel's: lm.lm_head.weight" in message or "lm.transformer" in message
    assert "missing lm_head.weight" in message or "missing transformer" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING), CheckpointWriter(tmp_path, 8) as writer:
        ModelWeights(wrapper.lm).write(writer, wrapper.lm.state_dict(), None)
    assert (writer.final_path / "config.json").is_file() and not caplog.text  # kept when true


def test_the_expected_names_are_the_classes_own_with_tied_and_ignored_ones():
    model = tiny_gpt2()
    config = AutoConfig.for_model(**model.config.to_dict())
    expected = expected_weights(config)
    assert expected.architecture == "GPT2LMHeadModel"
    saved = one_name_per_tensor(model)  # save_pretrained's names: the tied head left out
    assert "lm_head.weight" not in saved
    assert expected.mismatch({k: tuple(v.shape) for k, v in saved.items()}) is None
    prefixed = {f"lm.{k}": tuple(v.shape) for k, v in saved.items()}
    assert "not GPT2LMHeadModel's: lm.transformer" in expected.mismatch(prefixed)
    assert expected.prefix_of(prefixed) == "lm"
    wider = {**{k: tuple(v.shape) for k, v in saved.items()}, "transformer.wte.weight": (97, 16)}
    assert "transformer.wte.weight is [97, 16], the class has [96, 16]" in expected.mismatch(wider)
    assert hf_model_in(LMWrapper(model)) == ("lm", model)
    assert hf_model_in(nn.ModuleList([tiny_gpt2(), tiny_gpt2()])) is None  # which one?
    assert isinstance(model, GPT2LMHeadModel)


def test_a_config_forge_cannot_check_is_kept_and_exported_as_it_is(tmp_path, caplog):
    from forge.read.reader import export_model

    custom = {  # a model with its own code (trust_remote_code), which forge never runs
        "model_type": "my_custom_lm",
        "architectures": ["MyCustomLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_my.MyCustomLM"},
    }
    net = nn.Linear(4, 4)
    with caplog.at_level(logging.WARNING), CheckpointWriter(tmp_path, 2) as writer:
        ModelWeights(net).write(writer, net.state_dict(), None)
        writer.save_json("config.json", custom)
        writer.save_json("modeling_my.py", "# the model's code")
    assert json.loads((writer.final_path / "config.json").read_text()) == custom
    assert "not a Hugging Face model directory" not in caplog.text
    export_model(writer.final_path, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == custom
    assert (tmp_path / "out" / "modeling_my.py").is_file()
    assert "names are not checked against config.json" in caplog.text
    assert "model type 'my_custom_lm' is not one transformers knows" in caplog.text
