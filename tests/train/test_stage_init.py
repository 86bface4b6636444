"""Building one pipeline stage leaves transformers and torch as they were, during the build and
after a failed one, and says (once, as a warning) when it builds the whole model instead."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import transformers.modeling_utils as hf
from torch.nn.modules import module as torch_module
from transformers import LlamaForCausalLM

import forge.train.pipeline.stage_init as stage_init
from forge.train.pipeline.stage_init import build_partial_model
from tests.train.common import tiny_llama_config

KEPT = ["model.layers.1", "model.norm", "lm_head"]


def library_state() -> dict[str, object]:
    """What a build could leave changed: transformers' initialisation entry points, torch's
    global module hooks, the default device, an active dispatch mode."""
    return {
        "_initialize_weights": hf.PreTrainedModel.__dict__["_initialize_weights"],
        "initialize_weights": hf.PreTrainedModel.__dict__["initialize_weights"],
        "device function": hf.get_torch_context_manager_or_global_device,
        "registration hooks": dict(torch_module._global_module_registration_hooks),
        "default device": torch.empty(()).device,
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
    }


class Watched(LlamaForCausalLM):
    """Records the library while it is being built (inside the stage build)."""

    seen: list[dict[str, object]] = []

    def __init__(self, config) -> None:
        super().__init__(config)
        Watched.seen.append(library_state())


class FailsHalfway(LlamaForCausalLM):
    """Its inner model is built (and initialised), then the constructor fails."""

    def __init__(self, config) -> None:
        super().__init__(config)
        raise RuntimeError("the checkpoint to load is missing")


class NoMeta(LlamaForCausalLM):
    """Reads a value while it is built, which no meta tensor has."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scale = float(torch.ones(1).sum().item())


def test_building_a_stage_patches_nothing():
    before = library_state()
    Watched.seen = []
    torch.manual_seed(0)
    stage = build_partial_model(functools.partial(Watched, tiny_llama_config()), KEPT)
    assert not stage.lm_head.weight.is_meta and stage.model.layers[0].mlp.up_proj.weight.is_meta
    during = dict(Watched.seen[0])
    # the build's own registration hook and modes are expected while it runs; nothing else
    del during["registration hooks"], during["default device"], during["dispatch modes"]
    assert during == {k: v for k, v in before.items() if k in during}
    assert library_state() == before
    assert "_initialize_weights" not in vars(stage) and "_initialize_weights" not in vars(
        stage.model
    )


def test_a_failed_build_leaves_the_libraries_as_they_were():
    before = library_state()
    with pytest.raises(RuntimeError, match="the checkpoint to load is missing"):
        build_partial_model(functools.partial(FailsHalfway, tiny_llama_config()), KEPT)
    assert library_state() == before
    whole = LlamaForCausalLM(tiny_llama_config())  # and models build as before
    assert not any(t.is_meta for t in whole.parameters())


def test_a_model_that_cannot_be_built_on_meta_is_built_whole_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(stage_init, "_warned_whole", set(), raising=False)
    init = functools.partial(NoMeta, tiny_llama_config())
    torch.manual_seed(3)
    whole = init().state_dict()
    after_whole = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="forge"):
        for _ in range(2):
            torch.manual_seed(3)
            stage = build_partial_model(init, KEPT)
    assert torch.equal(torch.get_rng_state(), after_whole)
    for name, tensor in stage.state_dict().items():
        if not tensor.is_meta:
            assert torch.equal(tensor, whole[name]), name
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "building the whole model for this pipeline stage" in message
    assert "building it on the meta device failed" in message and "item()" in message
    assert "each rank holds the whole model" in message
