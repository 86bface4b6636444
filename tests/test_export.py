"""forge export: one Hugging Face model directory from a checkpoint of any layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from forge.checkpoint import CheckpointWriter
from forge.errors import RuntimeFailure, UsageError
from forge.export import export_model
from tests.train.common import tiny_llama_config


@pytest.fixture
def model() -> LlamaForCausalLM:
    """The tiny Llama with its output head tied to the embedding, as tiny_lm's is."""
    config = tiny_llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def whole_checkpoint(model, root, **save):
    """A checkpoint as the plain trainer writes it (save_pretrained), with training state."""
    with CheckpointWriter(root, 1) as writer:
        writer.save_model(model, **save)
        writer.save_torch("optimizer.pt", {"state": {}})
    return writer.final_path


def stage_checkpoint(model, root):
    """A checkpoint as two pipeline stages write it: a shard each, an index, the config."""
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    first = {k: v for k, v in state.items() if k.startswith(("model.embed", "model.layers.0"))}
    last = {k: v for k, v in state.items() if k not in first}
    names = [f"model-stage-{k:05d}-of-00002.safetensors" for k in range(2)]
    with CheckpointWriter(root, 1) as writer:
        writer.save_safetensors(names[0], first)
        writer.save_safetensors(names[1], last)
        writer.index_weights(names)
        model.config.save_pretrained(writer.path)
        writer.save_torch("optimizer-stage-00000-of-00002.pt", {"state": {}})
    return writer.final_path


def exported_tensors(out) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    tensors = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(out / name))
    return tensors


@pytest.mark.parametrize("layout", ["whole", "stages"])
def test_export_holds_the_checkpoints_tensors_and_loads_with_from_pretrained(
    model, tmp_path, layout
):
    make = whole_checkpoint if layout == "whole" else stage_checkpoint
    ckpt = make(model, tmp_path / "ckpt")
    out = tmp_path / "out"
    assert export_model(ckpt, out) == ckpt
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]  # no state
    tensors = exported_tensors(out)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_large_model_is_sharded_as_save_pretrained_shards_it(model, tmp_path):
    ckpt = whole_checkpoint(model, tmp_path / "ckpt")
    export_model(ckpt, tmp_path / "out", max_shard_size="20KB")
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    tensors = exported_tensors(out)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_non_empty_output_is_refused_without_force(model, tmp_path):
    ckpt = whole_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="exists and is not empty; .* pass --force"):
        export_model(ckpt, out)
    assert (out / "notes.txt").read_text() == "keep me"
    export_model(ckpt, out, force=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_a_checkpoint_of_a_model_that_is_not_a_hugging_face_one_is_named(tmp_path):
    ckpt = whole_checkpoint(torch.nn.Linear(4, 4), tmp_path / "ckpt")
    with pytest.raises(RuntimeFailure, match="has no config.json"):
        export_model(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
