"""One unwrap for every place that needs the model itself: parallel and compile wrappers are
peeled, a PEFT model is kept (it is the trained model) unless asked to go through it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from forge.train import LossAdapter
from forge.train.loss import default_label_names
from forge.wrappers import is_peft_model, unwrap_model
from tests.checkpoint.checkpoint_helpers import tiny_llama


def test_parallel_compile_and_loss_wrappers_are_peeled_in_any_nesting(tmp_path):
    model = nn.Linear(4, 4)
    assert unwrap_model(model) is model
    assert unwrap_model(nn.DataParallel(model)) is model
    assert unwrap_model(torch.compile(model)) is model
    assert unwrap_model(LossAdapter(model)) is model
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:  # DistributedDataParallel, as the plain trainer and Accelerate's prepare wrap it
        ddp = nn.parallel.DistributedDataParallel(model)
        assert unwrap_model(ddp) is model
        assert unwrap_model(torch.compile(ddp)) is model
        assert unwrap_model(nn.parallel.DistributedDataParallel(torch.compile(model))) is model
    finally:
        dist.destroy_process_group()


def test_a_peft_model_is_kept_and_unwrapped_through_only_when_asked():
    from peft import LoraConfig, get_peft_model

    base = tiny_llama()
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    wrapped = torch.compile(nn.DataParallel(peft_model))
    assert is_peft_model(peft_model) and not is_peft_model(base)
    kept = unwrap_model(wrapped)
    assert kept is peft_model
    # what a checkpoint holds and a resume loads: the adapter's names, under peft's prefix
    names = list(kept.state_dict())
    assert any("lora_A" in n for n in names) and all(n.startswith("base_model.") for n in names)
    inner = unwrap_model(wrapped, through_adapters=True)
    assert inner is base  # the transformers model (with the adapter layers in it)
    assert type(inner).__name__ == "LlamaForCausalLM"
    assert default_label_names(wrapped) == ["labels"]  # its forward names the labels
