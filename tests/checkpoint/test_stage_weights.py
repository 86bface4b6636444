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


def test_a_skeleton_on_the_meta_device_is_checked_against_the_headers_only(tmp_path, monkeypatch):
    """A pipeline's plan builds the model on the meta device, through a builder that loads its
    weights (LoRA's base model): names and shapes are checked, no value is read (a base of many
    GB is not read for a plan), and torch's warning per weight ("copying from a non-meta
    parameter ... is a no-op") is not raised."""
    import warnings

    from safetensors import safe_open

    with CheckpointWriter(tmp_path, 1) as writer:
        writer.save_model(Net())
    read = []
    real = safe_open

    class Handle:  # safe_open's handle, noting each tensor read
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

    class Counting:
        def __init__(self, *args, **kwargs):
            self.opened = real(*args, **kwargs)

        def __enter__(self):
            return Handle(self.opened.__enter__())

        def __exit__(self, *exc):
            return self.opened.__exit__(*exc)

    monkeypatch.setattr("safetensors.safe_open", Counting)
    with torch.device("meta"):
        skeleton, wrong = Net(), nn.Linear(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's no-op warning would fail here
        load_model_weights(skeleton, writer.final_path)
    assert read == [] and all(t.is_meta for t in skeleton.state_dict().values())
    whole_wrong = Net()
    with torch.device("meta"):
        whole_wrong.layers[1] = wrong
    with pytest.raises(CheckpointError, match="size mismatch for layers.1.weight"):
        load_model_weights(whole_wrong.to("meta"), writer.final_path)
