"""A pipeline stage's weights: written under the whole model's names, read back by name from a
checkpoint of any split, strictly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forge.checkpoint import CheckpointError, CheckpointWriter, ModelWeights, load_model_weights


class Net(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))


def stage_of(net: Net, keep: list[int]) -> Net:
    """``net`` with only the layers in ``keep`` (their names unchanged, as a pipeline stage)."""
    net.layers = nn.ModuleDict({str(i): net.layers[i] for i in keep})
    return net


def test_a_stage_loads_exactly_its_own_names_from_a_whole_model_checkpoint(tmp_path):
    torch.manual_seed(0)
    whole = Net()
    with CheckpointWriter(tmp_path, 1) as writer:
        writer.save_model(whole)
    torch.manual_seed(1)
    stage = stage_of(Net(), [2, 3])
    ModelWeights(stage, subset=True).load_checkpoint(writer.final_path, None)
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, whole.state_dict()[name]), name
    with pytest.raises(CheckpointError, match="unexpected keys: layers.0.bias"):
        load_model_weights(stage_of(Net(), [2, 3]), writer.final_path)  # not as a subset


def test_stage_files_load_into_another_split_and_a_missing_name_is_named(tmp_path):
    torch.manual_seed(0)
    whole = Net()
    state = whole.state_dict()
    with CheckpointWriter(tmp_path, 1) as writer:  # two stages' files and their index
        for k, layers in enumerate(([0, 1], [2, 3])):
            own = {n: t for n, t in state.items() if int(n.split(".")[1]) in layers}
            writer.save_safetensors(f"model-stage-{k:05d}-of-00002.safetensors", own)
        writer.index_weights([f"model-stage-{k:05d}-of-00002.safetensors" for k in range(2)])
    middle = stage_of(Net(), [1, 2])  # a split across both files
    load_model_weights(middle, writer.final_path, subset=True)
    assert torch.equal(middle.layers["1"].weight, whole.layers[1].weight)
    assert torch.equal(middle.layers["2"].weight, whole.layers[2].weight)
    restored = Net()
    load_model_weights(restored, writer.final_path)  # the whole model, from the stages
    assert torch.equal(restored.layers[3].bias, whole.layers[3].bias)
    too_big = stage_of(Net(5), [3, 4])
    with pytest.raises(CheckpointError, match="missing keys: layers.4.bias, layers.4.weight"):
        load_model_weights(too_big, writer.final_path, subset=True)
