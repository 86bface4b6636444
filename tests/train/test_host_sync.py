"""Steps that neither log nor checkpoint never wait for the device.

The loop keeps a step's loss, token count, gradient norm and skip decision on the device and
reads them on the host only at logging steps and checkpoints; a non-finite step is skipped on
the device by the fused optimizer (torch's ``found_inf``, as under a grad scaler). These tests
count host reads of tensors per step on CPU (tests/train/host_reads.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge.data import CausalLMCollator
from forge.train import Trainer, TrainerCallback
from tests.train.common import TokenDataset, make_args
from tests.train.host_reads import HostReads, SmallLM, quiet_steps

REPO = Path(__file__).resolve().parents[2]


class Weights(TrainerCallback):
    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}


class InfLossAt(Trainer):
    """The loss of step ``bad_step`` is infinite (on the device: no read to find out)."""

    bad_step = 3

    def compute_loss(self, model, batch):
        loss = super().compute_loss(model, batch)
        return loss * float("inf") if self.state.global_step + 1 == self.bad_step else loss


def train_counting(tmp_path, trainer_cls=Trainer, optimizer=None, host_skip=False, **overrides):
    """12 steps (logs at 4, 8, 12, checkpoints at 6, 12) counting host reads per step."""
    reads, weights = HostReads(), Weights()
    values = dict(
        max_steps=12,
        logging_steps=4,
        save_strategy="steps",
        save_steps=6,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
    )
    values.update(overrides)
    args = make_args(tmp_path, **values)
    trainer = trainer_cls(
        SmallLM,
        args,
        TokenDataset(64),
        data_collator=reads.collator(CausalLMCollator(pad_token_id=0)),
        callbacks=[reads, weights],
        optimizer=optimizer,
    )
    if host_skip:  # decide skips on the host, as for an optimizer without found_inf
        trainer._device_skippable_optimizer = lambda: None
    with reads:
        trainer.train()
    return trainer, reads.by_step(), weights.after


def test_steps_that_neither_log_nor_save_make_no_host_read(tmp_path):
    trainer, reads, weights = train_counting(tmp_path, trainer_cls=InfLossAt)
    quiet = quiet_steps(12, 4, 6)
    assert quiet == [1, 2, 3, 5, 7, 9, 10, 11]
    assert {step: reads[step] for step in quiet if step in reads} == {}
    # the count works: logging and saving steps read the numbers they report
    assert all(reads.get(step) for step in (4, 6, 8, 12))
    # the non-finite step 3 was still skipped, on the device, and counted at the next log
    for name, before in weights[2].items():
        assert torch.equal(before, weights[3][name]), name
    assert any(not torch.equal(v, weights[4][k]) for k, v in weights[3].items())
    assert trainer.state.nonfinite_skipped == 1
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {11}  # AdamW took 11 of 12 steps
    assert trainer.state.tokens_seen == 12 * 2 * 4 * 16


def test_an_optimizer_that_cannot_skip_on_the_device_reads_once_per_step(tmp_path, caplog):
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    caplog.set_level(logging.DEBUG, logger="forge")
    trainer, reads, weights = train_counting(tmp_path, trainer_cls=InfLossAt, optimizer=sgd)
    for step in quiet_steps(12, 4, 6):
        assert len(reads.get(step, [])) == 1, (step, reads.get(step))
    assert "SGD: each step waits for its gradients" in caplog.text
    # said once, and on the CPU (nothing runs ahead of the host to wait for) at debug level
    said = [r for r in caplog.records if "each step waits" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.DEBUG]
    assert trainer.state.nonfinite_skipped == 1
    for name, before in weights[2].items():
        assert torch.equal(before, weights[3][name]), name


def test_without_skip_nonfinite_no_optimizer_needs_a_read(tmp_path):
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    _, reads, _ = train_counting(tmp_path, optimizer=sgd, skip_nonfinite=False)
    quiet = quiet_steps(12, 4, 6)
    assert {step: reads[step] for step in quiet if step in reads} == {}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_device_skip_matches_the_host_decision(tmp_path, fused):
    """The fused optimizer's on-device skip ends where a host-side skip ends, bit for bit."""

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)

    a, _, _ = train_counting(tmp_path / "a", trainer_cls=InfLossAt, optimizer=adamw)
    b, _, _ = train_counting(tmp_path / "b", InfLossAt, optimizer=adamw, host_skip=True)
    assert (a._device_skippable_optimizer() is not None) == fused
    assert a.state.nonfinite_skipped == b.state.nonfinite_skipped == 1
    for name, value in a.model.state_dict().items():
        assert torch.equal(value, b.model.state_dict()[name]), name


@pytest.mark.integration
@pytest.mark.slow
def test_ddp_ranks_agree_on_a_signal_without_reads_on_quiet_steps(tmp_path):
    """Rank 0 is signalled at the end of quiet step 5; both ranks stop together two steps later
    (the stop rides in step 6's all-reduce and is read at step 7, not at the next logging step),
    and neither waits for the device during the quiet steps before it (the vote read a step late
    has landed)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(Path(__file__).with_name("ddp_sync_script.py")), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = sorted(
        (json.loads(path.read_text()) for path in tmp_path.glob("result-*.json")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in results] == [0, 1], proc.stdout + proc.stderr
    for result in results:
        assert result["stopped_at"] == 7, result  # signalled at 5: agreed in 6, read at 7
        assert result["quiet_reads"] == {}, result
        assert result["logging_step_reads"] > 0, result
    assert (tmp_path / "checkpoints" / "checkpoint-000007").is_dir()
