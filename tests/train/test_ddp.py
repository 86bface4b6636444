"""DDP with real processes (torchrun, gloo): stop + resume equals training straight through."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.common import (
    assert_same_tensors,
    checkpoint_dir,
    component_state,
    make_args,
    make_trainer,
    run_torchrun,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("ddp_resume_script.py")


def torchrun(mode: str, output_dir: Path) -> str:
    return run_torchrun(SCRIPT, mode, str(output_dir), timeout=600)


def final_state(output_dir: Path) -> dict:
    ckpt = checkpoint_dir(output_dir, 40)
    return {
        "weights": load_file(ckpt / "model.safetensors"),
        "optimizer": component_state(ckpt, "optimizer"),
        "rank0": {n: component_state(ckpt, n, rank=0) for n in ("data", "rng")},
        "rank1": {n: component_state(ckpt, n, rank=1) for n in ("data", "rng")},
    }


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    torchrun("straight", root / "straight")
    stopped = torchrun("stop", root / "resumed")
    assert "rank 0 interrupted at step 22" in stopped  # signalled after 20: agreed in 21
    assert "rank 1 interrupted at step 22" in stopped
    assert not checkpoint_dir(root / "resumed", 30).exists()
    torchrun("resume", root / "resumed")
    return root


def test_ddp_stop_and_resume_is_bit_identical(ddp_runs):
    straight = final_state(ddp_runs / "straight")
    resumed = final_state(ddp_runs / "resumed")
    assert_same_tensors(straight["weights"], resumed["weights"], "weights")
    assert_same_tensors(straight["optimizer"], resumed["optimizer"], "optimizer")
    for rank in ("rank0", "rank1"):  # random generators and data positions too
        assert_same_tensors(straight[rank], resumed[rank], rank)
    # every rank draws its own dropout masks
    assert not torch.equal(straight["rank0"]["rng"]["torch"], straight["rank1"]["rng"]["torch"])


def test_a_two_rank_checkpoint_resumes_in_one_process_with_a_warning(ddp_runs, tmp_path, caplog):
    args = make_args(
        tmp_path, max_steps=22, gradient_accumulation_steps=2, lr_scheduler_type="cosine"
    )
    trainer = make_trainer(args, train_size=232)
    with caplog.at_level(logging.WARNING, logger="forge.train"):
        trainer.train(resume_from_checkpoint=str(checkpoint_dir(ddp_runs / "straight", 20)))
    assert trainer.state.global_step == 22
    assert "written by 2 rank(s), this job has 1" in caplog.text
