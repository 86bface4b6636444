"""Sharded state (every rank's rows of each tensor) read back by rows, whole, or merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from forge.checkpoint.io import CheckpointError
from forge.checkpoint.layout import SHARDS_METADATA, component_file_names
from forge.checkpoint.sharded import RowReader, merge_sharded
from forge.checkpoint.weights import read_weights, weight_shapes


def write_shards(directory, whole: dict[str, torch.Tensor], ranks: int) -> None:
    """``whole`` as ``ranks`` shard files, rows split as FSDP2 splits them (torch.chunk)."""
    for rank in range(ranks):
        tensors, layout = {}, {}
        for name, tensor in whole.items():
            chunks = torch.chunk(tensor, ranks)
            offset = sum(len(c) for c in chunks[:rank])
            tensors[name] = chunks[rank].clone() if rank < len(chunks) else tensor[:0].clone()
            layout[name] = [offset, *tensor.shape]
        save_file(
            tensors,
            directory / f"model-shard-{rank:05d}-of-{ranks:05d}.safetensors",
            metadata={SHARDS_METADATA: json.dumps(layout)},
        )


def test_rows_are_read_from_the_files_that_hold_them(tmp_path):
    whole = {"a.weight": torch.arange(35.0).reshape(7, 5), "b.bias": torch.arange(3.0)}
    write_shards(tmp_path, whole, 2)
    reader = RowReader(tmp_path)
    assert torch.equal(reader.read("a.weight", 2, 6), whole["a.weight"][2:6])  # across files
    assert torch.equal(reader.read("a.weight"), whole["a.weight"])
    # the whole model for a plain reader, with the whole shapes (export checks them)
    loaded = read_weights(tmp_path)
    assert all(torch.equal(loaded[name], whole[name]) for name in whole)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert weight_shapes(files) == {"a.weight": (7, 5), "b.bias": (3,)}


def test_shards_of_a_component_merge_by_name_and_a_gap_is_an_error():
    moments = torch.arange(12.0).reshape(6, 2)
    shards = [
        {
            "tensors": {"state.w.exp_avg": moments[:3], "state.w.step": torch.tensor(4.0)},
            "layout": {"state.w.exp_avg": [0, 6, 2], "state.w.step": [0]},
            "other": {"param_groups.w.lr": 0.1},
        },
        {
            "tensors": {"state.w.exp_avg": moments[3:], "state.w.step": torch.tensor(4.0)},
            "layout": {"state.w.exp_avg": [3, 6, 2], "state.w.step": [0]},
            "other": {"param_groups.w.lr": 0.1},
        },
    ]
    merged = merge_sharded(shards)
    assert torch.equal(merged["state.w.exp_avg"], moments)
    assert merged["state.w.step"].item() == 4.0 and merged["param_groups.w.lr"] == 0.1
    with pytest.raises(CheckpointError, match="cover 3 of its 6 rows"):
        merge_sharded(shards[:1])


def test_the_manifest_names_one_file_per_rank():
    topology = {"world_size": 2, "num_stages": 1, "dp_size": 2}
    assert component_file_names("model", "sharded", True, topology) == [
        "model-shard-00000-of-00002.safetensors",
        "model-shard-00001-of-00002.safetensors",
    ]
    assert component_file_names("optimizer", "sharded", False, topology) == [
        "optimizer-shard-00000-of-00002.pt",
        "optimizer-shard-00001-of-00002.pt",
    ]


# ---------------------------------------------------------------------------------------------
# a tied embedding between a whole model and an FSDP2-sharded one (one rank in this process;
# tests/train/test_fsdp.py moves it between real ranks and trainers)


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in model.state_dict().items()
    }


def _save_sharded(model, checkpoints: Path, step: int) -> Path:
    from forge.checkpoint import CheckpointRegistry, CheckpointWriter
    from forge.checkpoint.components import model_component
    from forge.train.topology import Topology

    registry = CheckpointRegistry(Topology())
    registry.register(model_component(model, sharded=True))
    with CheckpointWriter(checkpoints, step) as writer:
        registry.save(writer)
    return checkpoints / f"checkpoint-{step:06d}"


def test_a_tied_embedding_moves_between_a_whole_and_a_sharded_checkpoint(one_rank, tmp_path):
    from forge.checkpoint.io import save_model_weights
    from forge.checkpoint.weights import load_model_weights, read_state_dict
    from tests.checkpoint.checkpoint_helpers import tiny_llama

    # save_pretrained stores the tied head once, as model.embed_tokens.weight
    whole = tiny_llama(0, tied=True)
    save_model_weights(whole, tmp_path / "whole")
    assert "lm_head.weight" not in read_weights(tmp_path / "whole")
    sharded = _sharded(tiny_llama(1, tied=True))
    load_model_weights(sharded, tmp_path / "whole")  # was: missing keys: lm_head.weight
    loaded = _full_state(sharded)
    assert sorted(loaded) == sorted(whole.state_dict())
    for name, tensor in whole.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    assert sharded.lm_head.weight is sharded.model.embed_tokens.weight  # still tied

    # the sharded save stores the tied tensor once too, and any reader takes it back
    checkpoint = _save_sharded(sharded, tmp_path / "checkpoints", 3)
    assert sorted(read_weights(checkpoint)) == sorted(read_weights(tmp_path / "whole"))
    back = tiny_llama(2, tied=True)
    load_model_weights(back, checkpoint)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    again = _sharded(tiny_llama(3, tied=True))
    load_model_weights(again, checkpoint)
    assert all(torch.equal(t, loaded[n]) for n, t in _full_state(again).items())
    # every name of the state dict, the tied one from the metadata (forge export's reader)
    assert sorted(read_state_dict(checkpoint)) == sorted(whole.state_dict())


def test_a_sharded_model_is_named_by_its_own_class(one_rank, tmp_path):
    """FSDP2 makes the model an FSDPLlamaForCausalLM; a message names the user's class."""
    from forge.checkpoint.io import save_model_weights
    from forge.checkpoint.weights import load_model_weights
    from tests.checkpoint.checkpoint_helpers import tiny_llama

    save_model_weights(tiny_llama(0, tied=True), tmp_path / "tied")
    untied = _sharded(tiny_llama(1))  # its head is a weight of its own, not in the checkpoint
    with pytest.raises(CheckpointError) as refused:
        load_model_weights(untied, tmp_path / "tied")
    assert "weights do not match LlamaForCausalLM (missing keys: lm_head.weight)" in str(
        refused.value
    )


def test_a_sharded_model_refuses_weights_of_another_shape_by_name(tmp_path):
    """A checkpoint of a wider model, loaded into a sharded one, is refused naming each tensor
    and both shapes (rows of the wrong width were read first, and torch's copy error named the
    model's shape as the checkpoint's too: "dimensions in the model are [8, 4] and ... in the
    checkpoint are [8, 4]")."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from forge.checkpoint.sharded import load_sharded_weights

    write_shards(tmp_path, {"weight": torch.zeros(8, 16), "bias": torch.zeros(8)}, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        model = fully_shard(nn.Linear(4, 8))
        with pytest.raises(
            CheckpointError, match=r"weight is \(8, 16\) in the checkpoint, \(8, 4\)"
        ):
            load_sharded_weights(model, tmp_path)
    finally:
        dist.destroy_process_group()
