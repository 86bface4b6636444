"""Running out of disk space while saving a checkpoint.

Whichever write meets the full disk (torch.save, safetensors, save_pretrained, a tokenizer,
JSON, the manifest, an fsync, the final rename) and in whatever form the library reports it,
the save ends in one DiskFullError that says how much the checkpoint needs and how much is
free; the partial checkpoint is gone and earlier checkpoints still validate and load.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TinyNet, assert_same_state, tiny_llama
from safetensors import SafetensorError
from torch import nn

from forge.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    find_latest_checkpoint,
    load_model_weights,
    load_torch_state,
    validate_checkpoint,
)
from forge.checkpoint.io import (
    DiskFullError,
    directory_bytes,
    disk_full_guard,
    estimate_checkpoint_bytes,
    format_bytes,
    free_bytes,
    tensor_bytes,
)
from tests.small_disk import mounted_tmpfs

# What the injection tests' full disk reports as free: under the 1 MiB below which a write
# failure that carries no errno (torch's RuntimeError) counts as a full disk.
FREE = 200_000

# Every form a write that runs out of space takes, as raised by the real libraries.
ERROR_FORMS: dict[str, Callable[[], Exception]] = {
    "oserror-enospc": lambda: OSError(errno.ENOSPC, "No space left on device"),
    "oserror-edquot": lambda: OSError(errno.EDQUOT, "Disk quota exceeded"),
    # torch.save to a path: the stream writer's check after a short write, no errno
    "torch-unexpected-pos": lambda: RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
    ),
    "torch-file-write-failed": lambda: RuntimeError(
        "[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file "
        "data/0: file write failed"
    ),
    "safetensors": lambda: SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    ),
}

_DiskUsage = namedtuple("_DiskUsage", "total used free")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def _save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, tokenizer, *, history=False):
    """Every kind of write a checkpoint makes; ``history`` adds a large file (see below)."""
    with CheckpointWriter(ckpt_dir, step) as writer:
        writer.save_model(model, tokenizer=tokenizer)
        writer.save_torch("training_state.pt", {"step": step, "exp_avg": torch.ones(4096)})
        writer.save_json("trainer_state.json", {"step": step})
        writer.save_safetensors("ema.safetensors", {"w": torch.full((256,), float(step))})
        if history:
            writer.save_torch("history.pt", torch.zeros(65536))
    return writer.final_path


def _write_partial(target) -> None:
    """What a write that runs out of space leaves: the start of the file."""
    with open(target, "wb") as f:
        f.write(b"partial")


def _fail_torch_save(monkeypatch, error):
    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            _write_partial(f)
        else:
            f.write(b"partial")
        raise error()

    monkeypatch.setattr(torch, "save", save)


def _fail_safetensors_save_file(monkeypatch, error):
    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        _write_partial(filename)
        raise error()

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def _fail_save_pretrained(monkeypatch, error):
    import transformers.modeling_utils

    def save_file(tensors, filename, metadata=None):
        _write_partial(filename)
        raise error()

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


def _fail_tokenizer(monkeypatch, error):
    from transformers import PreTrainedTokenizerFast

    def save_pretrained(self, directory, *args, **kwargs):
        _write_partial(Path(directory) / "tokenizer.json")
        raise error()

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save_pretrained)


def _fail_fsync_of(predicate: Callable[[str], bool]):
    def install(monkeypatch, error):
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if predicate(Path(os.readlink(f"/proc/self/fd/{fd}")).name):
                raise error()
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    return install


def _fail_rename(monkeypatch, error):
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name == ".tmp-checkpoint-000200":
            raise error()
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)


# (how the failure is installed, whether the checkpoint's model is a Hugging Face one)
WRITE_PATHS = {
    "torch.save": (_fail_torch_save, True),
    "safetensors-plain-model": (_fail_safetensors_save_file, False),
    "save_pretrained": (_fail_save_pretrained, True),
    "tokenizer": (_fail_tokenizer, True),
    "json": (_fail_fsync_of(lambda name: name == "trainer_state.json"), True),
    "safetensors-tensors": (_fail_fsync_of(lambda name: name == "ema.safetensors"), True),
    "manifest": (_fail_fsync_of(lambda name: name.startswith("manifest.json")), True),
    "commit-fsync": (_fail_fsync_of(lambda name: name == ".tmp-checkpoint-000200"), True),
    "commit-rename": (_fail_rename, True),
}


def _report_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _DiskUsage(10**12, 10**12 - free, free))


def _assert_earlier_intact(
    earlier: Path, ckpt_dir: Path, build: Callable[[], nn.Module]
) -> nn.Module:
    assert sorted(os.listdir(ckpt_dir)) == [earlier.name]  # no temporary directory left
    assert validate_checkpoint(earlier) == []
    assert find_latest_checkpoint(ckpt_dir) == earlier
    reloaded = build()
    load_model_weights(reloaded, earlier)
    return reloaded


@pytest.mark.parametrize("form", sorted(ERROR_FORMS))
@pytest.mark.parametrize("path", list(WRITE_PATHS))
def test_every_write_that_meets_a_full_disk_gives_one_clear_error(
    ckpt_dir, monkeypatch, caplog, path, form
) -> None:
    install, hf = WRITE_PATHS[path]
    model = tiny_llama(0) if hf else TinyNet()
    tokenizer = _tokenizer()
    # the earlier checkpoint is the larger (history.pt), so it is the estimate of the need
    earlier = _save_checkpoint(ckpt_dir, 100, model, tokenizer, history=True)
    previous_bytes = directory_bytes(earlier)

    install(monkeypatch, ERROR_FORMS[form])
    _report_free(monkeypatch, FREE)
    with pytest.raises(DiskFullError) as caught:
        _save_checkpoint(ckpt_dir, 200, model, tokenizer)
    monkeypatch.undo()

    error = caught.value
    assert isinstance(error, CheckpointError)
    message = str(error)
    assert message.startswith("disk full: could not ")
    assert str(ckpt_dir / "checkpoint-000200") in message
    needed = format_bytes(previous_bytes)
    assert f"needs about {needed} (the size of the previous checkpoint checkpoint-000100)" in (
        message
    )
    assert f"{format_bytes(FREE)} is free on the filesystem of {ckpt_dir}" in message
    assert "Free disk space" in message and "save_total_limit" in message
    assert "partial checkpoint was removed" in message
    assert "was not saved" not in caplog.text  # the error says it, once

    reloaded = _assert_earlier_intact(
        earlier, ckpt_dir, (lambda: tiny_llama(1)) if hf else (lambda: TinyNet())
    )
    assert_same_state(model, reloaded)
    assert load_torch_state(earlier / "training_state.pt")["step"] == 100


def test_without_an_earlier_checkpoint_the_need_is_the_tensors_being_saved(
    ckpt_dir, monkeypatch
) -> None:
    _fail_torch_save(monkeypatch, ERROR_FORMS["torch-unexpected-pos"])
    _report_free(monkeypatch, FREE)
    state = {"exp_avg": torch.zeros(2**18), "exp_avg_sq": torch.zeros(2**18)}  # 2 MiB
    with pytest.raises(DiskFullError) as caught:
        with CheckpointWriter(ckpt_dir, 1) as writer:
            writer.save_torch("optimizer.pt", state)
    monkeypatch.undo()
    assert tensor_bytes(state) == 2 * 2**20
    assert "needs about 2.0 MiB (the files written so far plus the tensors being saved)" in str(
        caught.value
    )
    assert os.listdir(ckpt_dir) == []


def test_tensor_bytes_counts_shared_storage_once() -> None:
    model = TinyNet()  # head.weight is embed.weight
    expected = sum(p.numel() * 4 for p in model.parameters()) + 4  # + the scale buffer
    assert tensor_bytes(model) == expected
    base = torch.zeros(100)
    assert tensor_bytes({"a": base, "b": [base, (base,)], "n": 3}) == 400


def test_a_write_failure_with_free_space_left_is_not_called_disk_full(
    write_checkpoint, ckpt_dir, monkeypatch
) -> None:
    earlier = write_checkpoint(100)
    _fail_torch_save(monkeypatch, ERROR_FORMS["torch-unexpected-pos"])
    _report_free(monkeypatch, 50 * 2**30)
    with pytest.raises(RuntimeError, match="unexpected pos") as caught:
        with CheckpointWriter(ckpt_dir, 200) as writer:
            writer.save_torch("training_state.pt", {"step": 200})
    assert not isinstance(caught.value, CheckpointError)

    _fail_torch_save(monkeypatch, lambda: OSError(errno.EIO, "Input/output error"))
    with pytest.raises(CheckpointError) as caught:
        with CheckpointWriter(ckpt_dir, 200) as writer:
            writer.save_torch("training_state.pt", {"step": 200})
    monkeypatch.undo()
    assert "Input/output error" in str(caught.value)
    assert "disk full" not in str(caught.value)
    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint-000100"]
    assert validate_checkpoint(earlier) == []


# ---------------------------------------------------------------------------------------------
# a real full disk: a 4 MiB tmpfs


@pytest.fixture
def small_disk(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "small", "4m") as mount:
        yield mount


def _figures(message: str) -> tuple[str, str]:
    match = re.search(r"needs about (.+?) \(.*\) and (.+?) is free", message)
    assert match, message
    return match.group(1), match.group(2)


def _big_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8192,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)  # about 2.2M parameters: 8.6 MiB in float32


def _big_plain() -> nn.Module:
    return nn.Linear(1024, 1536)  # 6 MiB of weights


def _big_state() -> dict[str, torch.Tensor]:
    return {"exp_avg": torch.ones(2**20), "exp_avg_sq": torch.ones(2**20)}  # 8 MiB


# (what is too big for the disk, how the writer saves it, the error the library raises)
BIG_SAVES = {
    # huggingface_hub's save_torch_state_dict, then safetensors' Rust writer: "os error 28"
    "plain": (_big_plain, lambda writer, model: writer.save_model(model), SafetensorError),
    # save_pretrained: safetensors again, through transformers
    "hf": (_big_llama, lambda writer, model: writer.save_model(model), SafetensorError),
    # torch.save into an open file: its stream writer turns the file's OSError into
    # RuntimeError("... unexpected pos ...") once the record is large (torch 2.13)
    "torch": (
        _big_state,
        lambda writer, state: writer.save_torch("optimizer.pt", state),
        (RuntimeError, OSError),
    ),
}


@pytest.mark.parametrize("kind", list(BIG_SAVES))
def test_a_real_full_disk(small_disk: Path, kind: str) -> None:
    build, save, raised = BIG_SAVES[kind]
    ckpt_dir = small_disk / "checkpoints"
    torch.manual_seed(0)
    small = nn.Linear(8, 4)
    with CheckpointWriter(ckpt_dir, 1) as writer:
        writer.save_model(small)
        writer.save_torch("training_state.pt", {"step": 1})
    earlier = writer.final_path
    free_before = free_bytes(small_disk)

    big = build()
    with pytest.raises(DiskFullError) as caught:
        with CheckpointWriter(ckpt_dir, 2) as writer:
            save(writer, big)
    assert isinstance(caught.value.__cause__, raised)
    message = str(caught.value)
    assert message.startswith("disk full: could not write ")
    needed, free = _figures(message)
    assert needed == format_bytes(tensor_bytes(big))  # the big save dwarfs step 1
    assert free_bytes(small_disk) == free_before  # every partial byte was given back
    assert free == format_bytes(free_before)

    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint-000001"]
    assert validate_checkpoint(earlier) == []
    reloaded = nn.Linear(8, 4)
    load_model_weights(reloaded, earlier)
    assert_same_state(small, reloaded)
    # the space is usable again: a checkpoint that fits is saved
    with CheckpointWriter(ckpt_dir, 2) as writer:
        writer.save_model(small)
    assert validate_checkpoint(writer.final_path) == []


def test_a_real_full_disk_under_torch_save_to_a_path(small_disk: Path) -> None:
    """torch.save given a path reports a full disk as a RuntimeError without errno."""
    target = small_disk / "optimizer.pt"
    state = _big_state()
    removed = []

    def cleanup() -> None:
        target.unlink()
        removed.append(target)

    with pytest.raises(DiskFullError) as caught:
        with disk_full_guard(
            "write optimizer.pt",
            small_disk,
            needed=lambda: estimate_checkpoint_bytes(small_disk, pending=state),
            cleanup=cleanup,
        ):
            torch.save(state, target)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert not isinstance(caught.value.__cause__, OSError)
    assert removed == [target]
    needed, free = _figures(str(caught.value))
    assert needed == "8.0 MiB"
    assert free == format_bytes(free_bytes(small_disk))


def test_a_full_disk_on_a_writer_thread_is_the_error_even_when_its_cleanup_broke_this_thread(
    ckpt_dir, monkeypatch
) -> None:
    """The race, made certain: the writer thread meets the full disk and removes the temporary
    directory while the calling thread is about to write into it. The calling thread's write
    then fails (the directory is gone), and the user must still be told of the full disk."""
    import threading

    removed = threading.Event()
    abort, target = CheckpointWriter._abort, CheckpointWriter._target

    def abort_then_tell(self) -> None:
        abort(self)
        removed.set()

    def target_after_the_cleanup(self, name: str) -> Path:
        if name == "trainer_state.json":  # the calling thread's write after the thread's
            assert removed.wait(60), "the writer thread never cleaned up"
            # what mkdir(exist_ok=True) raises when the directory goes between its two looks
            raise FileExistsError(errno.EEXIST, "File exists", str(self.path))
        return target(self, name)

    model, tokenizer = TinyNet(), _tokenizer()
    _save_checkpoint(ckpt_dir, 100, model, tokenizer)
    monkeypatch.setattr(CheckpointWriter, "_abort", abort_then_tell)
    monkeypatch.setattr(CheckpointWriter, "_target", target_after_the_cleanup)
    _fail_torch_save(monkeypatch, ERROR_FORMS["oserror-enospc"])
    _report_free(monkeypatch, FREE)
    with pytest.raises(DiskFullError) as caught:
        _save_checkpoint(ckpt_dir, 200, model, tokenizer)
    monkeypatch.undo()
    assert str(caught.value).startswith("disk full: could not ")
    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint-000100"]
