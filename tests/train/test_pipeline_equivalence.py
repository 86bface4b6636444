"""A pipeline trains like one process: same seed and data, the same losses step for step.

Each loop batch is split into microbatches that flow through the stages, the loss is taken on
the last stage, gradients of the tied embedding are summed over the first and last stage and
clipped by the norm over all stages; with equal-length sequences the mean of the microbatch
losses is the batch's mean loss, so only the order of float additions differs (about 1e-7).
Without the tied-gradient sum, or the gradient average over replicas, the losses part by far
more than the tolerance from step 2 on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train.common import run_torchrun
from tests.train.pipeline_script import STEPS, train

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("pipeline_script.py")


def torchrun(output_dir: Path, nproc: int, kind: str, **extra) -> None:
    run_torchrun(SCRIPT, str(output_dir), kind, json.dumps(extra), nproc=nproc)


def step_losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return [losses[step] for step in range(1, STEPS + 1)]


def merged_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for file in sorted(output_dir.glob("weights-rank-*.pt")):
        for name, tensor in torch.load(file, weights_only=True).items():
            assert name not in merged or torch.equal(merged[name], tensor), name
            merged[name] = tensor
    return merged


def assert_trains_alike(pipeline: Path, plain: Path) -> None:
    pipeline_losses, plain_losses = step_losses(pipeline), step_losses(plain)
    assert pipeline_losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    assert len(set(plain_losses)) == STEPS  # training moves: the comparison is not vacuous
    stages, whole = merged_weights(pipeline), torch.load(plain / "weights-rank-0.pt")
    # every parameter is written by exactly one stage; lm_head.weight is the tied embedding
    assert set(stages) == set(whole) - {"lm_head.weight"}
    assert "lm_head.weight" in whole
    for name, tensor in stages.items():
        torch.testing.assert_close(tensor, whole[name], rtol=1e-4, atol=1e-4, msg=name)


def test_two_stages_train_like_one_process(tmp_path):
    torchrun(tmp_path / "pipeline", 2, "pipeline")
    train(tmp_path / "plain", "plain")
    assert_trains_alike(tmp_path / "pipeline", tmp_path / "plain")


def test_two_stages_of_gpt2_train_like_one_process(tmp_path):
    """GPT-2 from its preset (embedding wte + wpe + drop, no rotary), with its default tied
    embeddings: the head on stage 1 shares stage 0's token embedding."""
    torchrun(tmp_path / "pipeline", 2, "pipeline", model="gpt2")
    train(tmp_path / "plain", "plain", model="gpt2")
    assert_trains_alike(tmp_path / "pipeline", tmp_path / "plain")


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    """Plain DDP, 2 processes x batch 4: 8 sequences per micro-batch."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun(out, 2, "plain")
    return out


@pytest.mark.slow
def test_four_stages_train_like_plain_ddp(plain_ddp, tmp_path):
    torchrun(tmp_path, 4, "pipeline", per_device_train_batch_size=8)  # one replica of batch 8
    assert_trains_alike(tmp_path, plain_ddp)


@pytest.mark.slow
def test_two_stages_times_two_replicas_train_like_plain_ddp(plain_ddp, tmp_path):
    torchrun(tmp_path, 4, "pipeline", pipeline_parallel_size=2)  # 2 replicas of batch 4
    assert_trains_alike(tmp_path, plain_ddp)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_other_schedules_train_like_one_process(schedule, tmp_path):
    extra = {"pipeline_schedule": schedule}
    if schedule == "interleaved_1f1b":
        extra["pipeline_stages_per_rank"] = 2  # 4 stages on 2 processes
    torchrun(tmp_path / "pipeline", 2, "pipeline", **extra)
    train(tmp_path / "plain", "plain")
    assert_trains_alike(tmp_path / "pipeline", tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "sharding"),
    [
        ("llama", {"fsdp": "full_shard"}),
        ("gpt2", {"fsdp": "full_shard"}),
        # ZeRO-2 around the stages' checkpointed layers
        ("llama", {"fsdp": "shard_grad_op", "activation_checkpointing": True}),
    ],
    ids=["llama", "gpt2", "zero2-checkpointed"],
)
def test_two_stages_times_two_shards_train_like_two_replicas(model, sharding, tmp_path):
    """Pipeline x FSDP: each of the 2 stages sharded over its 2 replicas trains as the same
    pipeline with whole replicas (DDP) does; the tied embedding's gradient is summed over
    the first and last stage on each rank's rows."""
    torchrun(tmp_path / "sharded", 4, "pipeline", model=model, pipeline_parallel_size=2,
             **sharding)  # fmt: skip
    torchrun(tmp_path / "replicated", 4, "pipeline", model=model, pipeline_parallel_size=2)
    sharded, replicated = step_losses(tmp_path / "sharded"), step_losses(tmp_path / "replicated")
    assert sharded == pytest.approx(replicated, rel=1e-5, abs=1e-6)
    assert len(set(replicated)) == STEPS
    ours, theirs = merged_weights(tmp_path / "sharded"), merged_weights(tmp_path / "replicated")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-4, msg=name)
