"""Writing checkpoints: HF and plain models, atomic commit, failures."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TinyNet, assert_same_state, tiny_llama
from torch import nn

from forge.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    find_checkpoints,
    find_latest_checkpoint,
    load_model_weights,
    load_torch_state,
    read_manifest,
    stage_weights_name,
    validate_checkpoint,
)


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % 128
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_round_trip(ckpt_dir: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama(0, tied=tied)
    with CheckpointWriter(ckpt_dir, 400) as writer:
        writer.save_model(model)
        assert writer.path.name == ".tmp-checkpoint-000400"
        assert not writer.final_path.exists()
    path = writer.final_path
    assert path == ckpt_dir / "checkpoint-000400"
    assert {"config.json", "model.safetensors", "manifest.json"} <= {p.name for p in path.iterdir()}
    assert validate_checkpoint(path) == []

    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert torch.equal(_logits(model), _logits(reloaded))

    other = tiny_llama(1, tied=tied)
    load_model_weights(other, path)
    assert_same_state(model, other)
    if tied:
        assert other.lm_head.weight is other.model.embed_tokens.weight


def test_sharded_hf_model_loads_both_ways(ckpt_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama(0)
    with CheckpointWriter(ckpt_dir, 10) as writer:
        writer.save_model(model, max_shard_size="20KB")
    path = writer.final_path
    shards = sorted(p.name for p in path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert not (path / "model.safetensors").exists()
    assert set(shards) | {"model.safetensors.index.json"} <= set(read_manifest(path).files)

    other = tiny_llama(1)
    load_model_weights(other, path)
    assert_same_state(model, other)
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert torch.equal(_logits(model), _logits(reloaded))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing torch._dynamo
def test_wrappers_are_unwrapped_and_tokenizer_saved(ckpt_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")

    class Wrapper(nn.Module):  # stands in for DDP: the model under .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = tiny_llama(0)
    compiled = torch.compile(Wrapper(model))  # ._orig_mod -> .module -> the model
    with CheckpointWriter(ckpt_dir, 5) as writer:
        writer.save_model(compiled, tokenizer)
    path = writer.final_path
    assert "tokenizer.json" in read_manifest(path).files
    assert AutoTokenizer.from_pretrained(path)("a b c")["input_ids"] == [1, 2, 0]
    other = tiny_llama(1)
    load_model_weights(Wrapper(other), path)
    assert_same_state(model, other)


@pytest.mark.parametrize("max_shard_size", ["2GB", 2000])
def test_plain_module_with_tied_weights(ckpt_dir: Path, max_shard_size) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    with CheckpointWriter(ckpt_dir, 1) as writer:
        writer.save_model(model, max_shard_size=max_shard_size)
    path = writer.final_path
    sharded = (path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size == 2000)
    assert validate_checkpoint(path) == []

    torch.manual_seed(1)
    other = TinyNet()
    other.scale.fill_(5.0)
    load_model_weights(other, path)
    assert_same_state(model, other)
    assert other.head.weight is other.embed.weight


def test_load_model_weights_reports_mismatched_keys(write_checkpoint) -> None:
    path = write_checkpoint(3)  # an nn.Linear(8, 4)
    with pytest.raises(CheckpointError, match=r"missing keys: 0\.bias, 0\.weight.*unexpected"):
        load_model_weights(nn.Sequential(nn.Linear(8, 4)), path)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_model_weights(nn.Linear(8, 5), path)
    with pytest.raises(CheckpointError, match="no model weights"):
        load_model_weights(nn.Linear(8, 4), path.parent)


def test_stage_files_get_an_index_and_load_into_the_full_model(ckpt_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama(0, tied=True)
    state = model.state_dict()
    first = {k: v for k, v in state.items() if "layers.1" not in k and not k.startswith("lm_head")}
    second = {k: v for k, v in state.items() if k not in first}
    with CheckpointWriter(ckpt_dir, 8, trainer="pipeline") as writer:
        writer.save_json("config.json", model.config.to_dict())
        writer.save_safetensors(stage_weights_name(0, 2), first)
        writer.save_safetensors(stage_weights_name(1, 2), second)
        writer.index_weights([stage_weights_name(0, 2), stage_weights_name(1, 2)])
    path = writer.final_path
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "model-stage-00000-of-00002.safetensors",
        "model-stage-00001-of-00002.safetensors",
    }
    assert read_manifest(path).trainer == "pipeline"
    other = tiny_llama(1, tied=True)
    load_model_weights(other, path)
    assert_same_state(model, other)
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert torch.equal(_logits(model), _logits(reloaded))


def test_exception_inside_block_leaves_no_checkpoint(write_checkpoint, ckpt_dir) -> None:
    earlier = write_checkpoint(100)
    with pytest.raises(ZeroDivisionError):
        with CheckpointWriter(ckpt_dir, 200) as writer:
            writer.save_torch("training_state.pt", {"step": 200})
            raise ZeroDivisionError
    assert not writer.path.exists()
    assert not writer.final_path.exists()
    assert [i.step for i in find_checkpoints(ckpt_dir)] == [100]
    assert find_latest_checkpoint(ckpt_dir) == earlier


def test_disk_full_while_writing_becomes_checkpoint_error(
    write_checkpoint, ckpt_dir, monkeypatch
) -> None:
    earlier = write_checkpoint(100)
    real_save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(CheckpointError) as caught:
        with CheckpointWriter(ckpt_dir, 200) as writer:
            writer.save_torch("training_state.pt", {"step": 200})
    monkeypatch.setattr(torch, "save", real_save)
    message = str(caught.value)
    assert str(ckpt_dir / "checkpoint-000200") in message
    assert message.startswith("disk full: could not write training_state.pt")
    assert not writer.path.exists() and not writer.final_path.exists()
    assert find_latest_checkpoint(ckpt_dir) == earlier
    assert validate_checkpoint(earlier) == []


def test_disk_full_during_commit_becomes_checkpoint_error(
    write_checkpoint, ckpt_dir, monkeypatch
) -> None:
    earlier = write_checkpoint(100)
    writer = CheckpointWriter(ckpt_dir, 100)  # replaces the existing step-100 checkpoint
    with pytest.raises(CheckpointError, match="disk full: could not commit"):
        with writer:
            writer.save_json("state.json", {"new": True})

            def fail(fd: int) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(os, "fsync", fail)
    monkeypatch.undo()
    assert not writer.path.exists()
    assert validate_checkpoint(earlier) == []
    assert "state.json" not in read_manifest(earlier).files


def test_same_step_is_replaced_atomically(write_checkpoint, ckpt_dir) -> None:
    write_checkpoint(100)
    with CheckpointWriter(ckpt_dir, 100) as writer:
        writer.save_json("state.json", {"version": 2})
    assert set(read_manifest(writer.final_path).files) == {"state.json"}
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint-000100"]


def test_stale_temp_dirs_are_swept_and_moved_aside_checkpoint_restored(
    write_checkpoint, ckpt_dir
) -> None:
    old = write_checkpoint(100)
    # as if killed between moving step 100 aside and renaming its replacement in
    os.rename(old, ckpt_dir / ".tmp-old-checkpoint-000100")
    (ckpt_dir / ".tmp-checkpoint-000100").mkdir()
    (ckpt_dir / ".tmp-checkpoint-000300").mkdir()
    (ckpt_dir / ".tmp-delete-checkpoint-000050-1234abcd").mkdir()
    # still discoverable under its temporary name until a writer restores it
    [info] = find_checkpoints(ckpt_dir)
    assert info.valid and info.path.name == ".tmp-old-checkpoint-000100" and info.step == 100
    with CheckpointWriter(ckpt_dir, 200) as writer:
        writer.save_json("state.json", {})
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint-000100", "checkpoint-000200"]
    assert validate_checkpoint(old) == []


def test_meta_world_and_extra_keys(ckpt_dir: Path) -> None:
    with CheckpointWriter(ckpt_dir, 3, trainer="accelerate") as writer:
        writer.save_torch("training_state.pt", {"step": 3})
        metrics = {"eval_loss": torch.tensor(0.5), "tags": {"a"}}  # a set is not JSON
        writer.set_meta(epoch=0.25, metrics=metrics, world={"nodes": 1})
        writer.set_meta(best_metric=0.5)
        with pytest.raises(ValueError, match="manifest fields"):
            writer.set_meta(files={})
        with pytest.raises(ValueError, match="not a file name"):
            writer.save_json("../escape.json", {})
    manifest = read_manifest(writer.final_path)
    assert manifest.epoch == 0.25
    assert manifest.metrics == {"eval_loss": 0.5, "tags": "{'a'}"}
    assert manifest.topology == {"world_size": 1, "num_stages": 1, "dp_size": 1, "nodes": 1}
    assert manifest.extra == {"best_metric": 0.5}
    assert manifest.trainer == "accelerate"
    assert load_torch_state(writer.final_path / "training_state.pt") == {"step": 3}


def test_writer_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs any_failed or a barrier"):
        CheckpointWriter(tmp_path, 1, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        CheckpointWriter(tmp_path, 1, rank=2, world_size=2, barrier=lambda: None)
    with pytest.raises(CheckpointError, match="shares"):
        # rank 1 with nobody creating the directory: not a shared filesystem
        with CheckpointWriter(tmp_path, 1, rank=1, world_size=2, barrier=lambda: None):
            pass


def test_failed_replace_puts_the_previous_checkpoint_back(
    write_checkpoint, ckpt_dir, monkeypatch
) -> None:
    earlier = write_checkpoint(100)
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name == ".tmp-checkpoint-000100":
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(CheckpointError, match=r"could not commit checkpoint .*Input/output error"):
        with CheckpointWriter(ckpt_dir, 100) as writer:
            writer.save_json("state.json", {})
    monkeypatch.undo()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint-000100"]
    assert validate_checkpoint(earlier) == []
    assert "state.json" not in read_manifest(earlier).files


def test_hf_model_whose_memory_layout_differs_from_disk(ckpt_dir: Path) -> None:
    """Mixtral keeps fused experts in memory and saves them per expert."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    with CheckpointWriter(ckpt_dir, 1) as writer:
        writer.save_model(model)
    torch.manual_seed(1)
    other = MixtralForCausalLM(config)
    load_model_weights(other, writer.final_path)
    assert_same_state(model, other)
