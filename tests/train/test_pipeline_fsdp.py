"""Pipeline x FSDP with real processes (torchrun, gloo on CPU): 2 stages x 2 shards on 4
processes, each stage sharded over its replicas. Each rank writes its share of its stage's
weights, optimizer state and moving average; the job survives SIGKILL and resumes bit for bit;
its checkpoint continues under the plain trainer and the plain pipeline, and a plain one
continues under it. (That it trains as pipeline x DDP: test_pipeline_equivalence.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from forge.checkpoint import read_manifest, validate_checkpoint
from forge.checkpoint.weights import read_weights
from forge.train.ema import read_ema_component
from tests.train.common import assert_same_tensors, checkpoint_dir
from tests.train.fsdp_script import STEPS
from tests.train.test_fsdp import (
    _continue_from,
    assert_each_rank_writes_its_share,
    finish,
    launch,
    losses,
    optimizer_state,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: the tiny Llama 4 times as wide (a file's cost per tensor is noise), with a moving average
MODE = "wide-ema"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The straight pipeline x FSDP run (4 processes) and one process's run of the same model."""
    root = tmp_path_factory.mktemp("ppfsdp")
    finish(launch(root / "ppfsdp", f"ppfsdp-{MODE}", nproc=4))
    finish(launch(root / "plain", f"plain-{MODE}", nproc=1))
    return root


def test_each_rank_writes_its_share_of_its_stage(straight):
    checkpoint = checkpoint_dir(straight / "ppfsdp", STEPS)
    assert validate_checkpoint(checkpoint) == []
    manifest = read_manifest(checkpoint)
    assert manifest.topology["world_size"] == 4
    assert manifest.topology["num_stages"] == 2
    assert manifest.components["model"]["files"] == [
        f"model-shard-{r:05d}-of-00004.safetensors" for r in range(4)
    ]
    # the bytes summed over the 4 ranks are one process's checkpoint of the same state
    assert_each_rank_writes_its_share(
        checkpoint, checkpoint_dir(straight / "plain", STEPS), ("model", "optimizer", "ema")
    )
    # the shards put back together are a whole model's tensors: each stage wrote its own
    whole = read_weights(checkpoint_dir(straight / "plain", STEPS))
    ours = read_weights(checkpoint)
    assert sorted(ours) == sorted(whole)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in whole.items()}
    assert sorted(optimizer_state(checkpoint)) == sorted(
        optimizer_state(checkpoint_dir(straight / "plain", STEPS))
    )


def test_it_trains_and_evaluates_with_the_average_as_whole_replicas_do(tmp_path):
    """The average kept on each rank's rows, swapped in for the evaluations (every 3 steps,
    the eval set split unevenly between the replicas: 3 batches each, the last of 3 and of 2
    items), gives the evaluation losses of the same pipeline with whole replicas."""
    finish(launch(tmp_path / "sharded", "ppfsdp-evalema", nproc=4))
    finish(launch(tmp_path / "replicated", "ppddp-evalema", nproc=4))
    ours, theirs = losses(tmp_path / "sharded"), losses(tmp_path / "replicated")
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert [ours[s] for s in sorted(ours)] == pytest.approx(
        [theirs[s] for s in sorted(ours)], rel=1e-5
    )
    evaluated = [eval_losses(tmp_path / run) for run in ("sharded", "replicated")]
    assert sorted(evaluated[0]) == [3, 6, 9]
    assert [evaluated[0][s] for s in (3, 6, 9)] == pytest.approx(
        [evaluated[1][s] for s in (3, 6, 9)], rel=1e-5
    )


def eval_losses(output_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


def test_sigkill_of_the_job_then_resume_is_bit_identical(straight, tmp_path):
    finish(launch(tmp_path / "run", f"ppfsdp-{MODE}", nproc=4, stop=6), killed=True)
    assert checkpoint_dir(tmp_path / "run", 6).exists()
    assert not checkpoint_dir(tmp_path / "run", 9).exists()
    finish(launch(tmp_path / "run", f"ppfsdp-{MODE}-resume", nproc=4))
    done, expected = checkpoint_dir(tmp_path / "run", STEPS), checkpoint_dir(straight / "ppfsdp", 9)
    assert_same_tensors(read_weights(expected), read_weights(done), "weights")
    assert_same_tensors(optimizer_state(expected), optimizer_state(done), "optimizer")
    assert_same_tensors(read_ema_component(expected), read_ema_component(done), "ema")
    reference, resumed = losses(straight / "ppfsdp"), losses(tmp_path / "run")
    assert [resumed[s] for s in (7, 8, 9)] == [reference[s] for s in (7, 8, 9)]


def test_the_checkpoint_continues_under_other_layouts_and_a_plain_one_under_it(straight, tmp_path):
    # pipeline x FSDP -> the plain trainer, one process (every stage's shards merged)
    _continue_from(straight / "ppfsdp", tmp_path / "to_plain", 6)
    finish(launch(tmp_path / "to_plain", f"plain-{MODE}-resume", nproc=1))
    # pipeline x FSDP -> the pipeline trainer, 2 stages unsharded
    _continue_from(straight / "ppfsdp", tmp_path / "to_pipeline", 6)
    finish(launch(tmp_path / "to_pipeline", f"pipeline-{MODE}-resume", nproc=2))
    # one process -> pipeline x FSDP (each rank takes its stage's rows)
    _continue_from(straight / "plain", tmp_path / "to_ppfsdp", 6)
    finish(launch(tmp_path / "to_ppfsdp", f"ppfsdp-{MODE}-resume", nproc=4))
    # each goes on with the rest of the epoch of the run it continues, dealt to its own
    # replicas: after 6 steps of 16 items (2 replicas), half of the second epoch is left,
    # which one process takes 8 items a step (its steps 7-8 take the items of the straight
    # run's step 7, its step 9 those of step 8); after one process's 6 steps of 8 items, the
    # 2 replicas take the first epoch's last 16 items (the straight run's step 4), then the
    # second epoch from its start (steps 5, 6): other weights, the same items
    reference = losses(straight / "ppfsdp")
    same_items = {
        "to_plain": {7: 7, 8: 7, 9: 8},
        "to_pipeline": {7: 7, 8: 7, 9: 8},
        "to_ppfsdp": {7: 4, 8: 5, 9: 6},
    }
    for run, steps in same_items.items():
        found = losses(tmp_path / run)
        assert sorted(found) == [7, 8, 9], run
        for step, at in steps.items():
            assert found[step] == pytest.approx(reference[at], rel=0.03), (run, step)
    # one process and the unsharded pipeline read the same state from the shards
    plain, pipeline = losses(tmp_path / "to_plain"), losses(tmp_path / "to_pipeline")
    assert [pipeline[s] for s in (7, 8, 9)] == pytest.approx(
        [plain[s] for s in (7, 8, 9)], rel=1e-5
    )
    # the weights each run loaded are the checkpoint's, whatever its layout
    for run, source in {
        "to_plain": straight / "ppfsdp",
        "to_pipeline": straight / "ppfsdp",
        "to_ppfsdp": straight / "plain",
    }.items():
        held: dict[str, torch.Tensor] = {}
        for file in sorted((tmp_path / run).glob("loaded-rank-*.pt")):
            held.update(torch.load(file, weights_only=True))
        saved = read_weights(checkpoint_dir(source, 6))
        assert sorted(held) == sorted(saved), run
        assert_same_tensors(saved, held, run)
    resumed = checkpoint_dir(tmp_path / "to_ppfsdp", STEPS)
    assert read_manifest(resumed).components["optimizer"]["scope"] == "sharded"
    assert_each_rank_writes_its_share(
        resumed, checkpoint_dir(straight / "plain", STEPS), ("model", "optimizer", "ema")
    )


def test_the_read_side_reads_it(straight, tmp_path):
    """export (with and without the average) and forge.load give the model the shards hold."""
    from transformers import AutoModelForCausalLM

    import forge
    from forge.read.reader import export_model

    checkpoint = checkpoint_dir(straight / "ppfsdp", STEPS)
    weights = read_weights(checkpoint)
    export_model(checkpoint, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert_same_tensors(weights, {k: exported.state_dict()[k] for k in weights}, "export")
    export_model(checkpoint, tmp_path / "hf-ema", ema=True)
    averaged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-ema").state_dict()
    average = read_ema_component(checkpoint)["weights"]
    assert_same_tensors(average, {k: averaged[k] for k in average}, "export --ema")
    model = forge.load(checkpoint)
    assert_same_tensors(weights, {k: model.state_dict()[k] for k in weights}, "forge.load")
