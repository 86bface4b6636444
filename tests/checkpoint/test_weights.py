"""The one weights reader: what the trainers load, export writes out and generate samples from."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import tiny_llama
from transformers import AutoModelForCausalLM

from forge.checkpoint import CheckpointError
from forge.checkpoint.io import WEIGHTS_INDEX_NAME, save_tensors, write_weights_index
from forge.checkpoint.weights import load_pretrained, read_weights, weight_files


def test_a_hugging_face_directory_loads_as_from_pretrained_would(tmp_path):
    """Built from its config in the dtype it records, filled by forge's reader: the same
    tensors, dtype and generation config as transformers' own loader gives."""
    model = tiny_llama(tied=True).to(torch.bfloat16)
    model.generation_config.max_new_tokens = 7
    model.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, AutoModelForCausalLM)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and not ours.training
    assert ours.generation_config.max_new_tokens == 7
    mine, other = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == other.keys()
    assert all(torch.equal(mine[k], other[k]) for k in mine)


def test_per_file_weights_are_found_by_their_index_and_clashes_are_refused(tmp_path):
    first = {"a": torch.zeros(2), "shared": torch.ones(2)}
    save_tensors(tmp_path / "model-stage-00000-of-00002.safetensors", first, None)
    save_tensors(tmp_path / "model-stage-00001-of-00002.safetensors", {"b": torch.ones(3)}, None)
    write_weights_index(tmp_path, sorted(p.name for p in tmp_path.glob("*.safetensors")))
    files, _ = weight_files(tmp_path)
    assert [f.name for f in files] == [
        "model-stage-00000-of-00002.safetensors",
        "model-stage-00001-of-00002.safetensors",
    ]
    assert set(read_weights(tmp_path)) == {"a", "b", "shared"}
    # a name in two files with other values: which is the model's? (a tied copy is fine)
    (tmp_path / WEIGHTS_INDEX_NAME).unlink()
    save_tensors(
        tmp_path / "model-stage-00001-of-00002.safetensors", {"shared": torch.ones(2)}, None
    )
    assert torch.equal(read_weights(tmp_path)["shared"], torch.ones(2))
    save_tensors(
        tmp_path / "model-stage-00001-of-00002.safetensors", {"shared": torch.zeros(2)}, None
    )
    with pytest.raises(CheckpointError, match="holds shared again, with other values than"):
        read_weights(tmp_path)
