"""host_copy: the first phase of a save copies state to host memory, detached from training."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from forge.checkpoint.snapshot import host_copy


def test_the_copy_shares_no_memory_with_the_state_and_keeps_its_shape():
    weight = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    weight.requires_grad_(True)
    state = {"w": weight, "nested": [torch.ones(2), (3, "x")], "step": 5}
    copied = host_copy(state)
    with torch.no_grad():
        weight.add_(100.0)
        state["nested"][0].add_(1.0)
    assert torch.equal(copied["w"], torch.arange(12.0).reshape(3, 4).t())
    assert copied["w"].is_contiguous() and not copied["w"].requires_grad
    assert copied["w"].device.type == "cpu"
    assert torch.equal(copied["nested"][0], torch.ones(2))
    assert copied["nested"][1] == (3, "x") and copied["step"] == 5


def test_tied_tensors_stay_one_tensor_and_module_metadata_is_kept():
    embedding = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = embedding.weight  # tied, as an LM's head and embeddings
    model = nn.ModuleDict({"embed": embedding, "head": head})
    state = model.state_dict()
    copied = host_copy(state)
    assert isinstance(copied, OrderedDict) and list(copied) == list(state)
    assert copied["embed.weight"] is copied["head.weight"]
    assert copied["embed.weight"].data_ptr() != state["embed.weight"].data_ptr()
    assert copied._metadata == state._metadata


def test_other_objects_are_deep_copied():
    class Box:
        def __init__(self) -> None:
            self.items = [1]

    box = Box()
    copied = host_copy({"box": box})
    box.items.append(2)
    assert copied["box"].items == [1]
