"""Shared pieces of the trainer tests: a tiny random Llama, synthetic token data, comparisons."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from forge.data import CausalLMCollator
from forge.train import Trainer, TrainerCallback, TrainingArguments

VOCAB = 128
SEQ_LEN = 16


def tiny_llama_config() -> LlamaConfig:
    """2 layers, hidden 32, 4 heads; attention dropout on, so resume must restore the RNG."""
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_llama_init() -> functools.partial:
    """A zero-argument model builder, as a config's ``!partial`` would give."""
    return functools.partial(LlamaForCausalLM, tiny_llama_config())


class TokenDataset(Dataset):
    """``n`` random token sequences from a seeded generator; items ``{"input_ids": ...}``."""

    def __init__(self, n: int, seq_len: int = SEQ_LEN, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index]}


def make_args(output_dir: str | os.PathLike, **overrides: Any) -> TrainingArguments:
    """Small defaults for tests: no progress bar or TensorBoard unless asked."""
    values: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": 12,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1e-3,
        "logging_steps": 4,
        "save_strategy": "no",
        "eval_strategy": "no",
        "report_to": "none",
    }
    values.update(overrides)
    return TrainingArguments(**values)


def make_trainer(
    args: TrainingArguments,
    *,
    train_size: int = 64,
    eval_size: int | None = None,
    trainer_cls: type[Trainer] = Trainer,
    **kwargs: Any,
) -> Trainer:
    eval_dataset = TokenDataset(eval_size, seed=1) if eval_size else None
    return trainer_cls(
        tiny_llama_init(),
        args,
        TokenDataset(train_size),
        eval_dataset=eval_dataset,
        data_collator=CausalLMCollator(pad_token_id=0),
        **kwargs,
    )


class SignalAtStep(TrainerCallback):
    """Sends a signal to this very process at the end of ``step`` (the real signal path)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class StopAtStep(TrainerCallback):
    """Asks the loop to stop after ``step`` (as early stopping would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class StopAfterSave(TrainerCallback):
    """Stops right after the checkpoint of ``step`` is saved (e.g. an epoch-end save).

    Only with synchronous saves: under ``async_save`` ``on_save`` comes once the commit has
    ended, a step or more later, and the run would stop there instead."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_begin(self, args, state, control, **kwargs):
        assert args.async_save is False, "StopAfterSave needs async_save=False"

    def on_save(self, args, state, control, checkpoint_path=None, metrics=None, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def component_state(checkpoint: Path, name: str, rank: int | None = None) -> Any:
    """The saved state of one checkpoint component (its file found through the manifest)."""
    from forge.checkpoint import read_manifest

    files = read_manifest(checkpoint).components[name]["files"]
    if rank is not None:
        files = [f for f in files if f.endswith(f"-rank-{rank:05d}.pt")]
    (file,) = files
    return torch.load(checkpoint / file, weights_only=True)["state"]


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"checkpoint-{step:06d}"


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    """Bit-equal nested tensors (dicts, lists, scalars compared with ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a, b), f"tensors differ at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_training(a: Trainer, b: Trainer) -> None:
    """Every model tensor and every optimizer state tensor is bit-identical."""
    assert_same_tensors(a.model.state_dict(), b.model.state_dict(), "model")
    assert_same_tensors(
        a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"], "optimizer"
    )
    assert a.lr_scheduler.state_dict()["last_epoch"] == b.lr_scheduler.state_dict()["last_epoch"]


def run_torchrun(
    script: Path, *args: str, nproc: int = 2, timeout: float = 900, expect_failure: bool = False
) -> str:
    """``script args`` on ``nproc`` real processes under torchrun (gloo); its output. Fails with
    that output on a non-zero exit (on a zero exit with ``expect_failure``); after ``timeout``
    seconds ends torchrun and its workers (their own session) and fails."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(script), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"torchrun {script.name} timed out:\n{output}") from None
    assert (proc.returncode != 0) == expect_failure, output
    return output
