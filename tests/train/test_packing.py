"""Padding-free packing (forge/train/packing.py): packed sequences stay apart in a model that
honours their position_ids, a model that would mix them is refused with the reason, and a
packed run trains with its loss, label tokens, tokens and items counted as the sequences'."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from forge.train.loop_state import count_tokens
from forge.train.packing import (
    is_packed_batch,
    packing_leak,
    packing_refusal,
    packs_sequences,
    sequence_count,
)
from tests.cli.small_lm import SMALL_LM, defines
from tests.helpers import TINY_LM, run_forge
from tests.plain_project import write_project

LENGTHS = (5, 11, 3, 8)


def tiny_llama(attn_implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
        use_cache=False,  # as the trainer sets it (trainer.args.use_cache: false)
    )
    return LlamaForCausalLM(config).eval()


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 97, (n,), generator=generator) for n in LENGTHS]


def packed_batch() -> dict[str, torch.Tensor]:
    return DataCollatorWithFlattening()([{"input_ids": ids} for ids in sequences()])


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_logits_equal_each_sequence_alone(attn_implementation):
    model, batch = tiny_llama(attn_implementation), packed_batch()
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = torch.cat([model(input_ids=ids[None]).logits[0] for ids in sequences()])
    torch.testing.assert_close(packed[0], alone, atol=1e-5, rtol=1e-5)
    assert packing_refusal(model, batch_keys=list(batch)) is None
    assert packing_leak(model, batch) is None


def test_packed_loss_is_the_token_mean_of_the_sequences_losses():
    """Labels are separated (-100 at each sequence's start): the packed loss is the mean over
    the label tokens of all sequences, and those are the tokens num_items_in_batch counts."""
    model, batch = tiny_llama("sdpa"), packed_batch()
    with torch.no_grad():
        packed = model(**batch).loss
        losses = [model(input_ids=ids[None], labels=ids[None]).loss for ids in sequences()]
    targets = [n - 1 for n in LENGTHS]
    expected = sum(loss * n for loss, n in zip(losses, targets, strict=True)) / sum(targets)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)
    assert int(batch["labels"][..., 1:].ne(-100).sum()) == sum(targets)  # num_items_in_batch's
    assert count_tokens(batch) == sum(LENGTHS)  # tokens_per_second and FLOPs: no padding
    assert int(sequence_count(batch)) == len(LENGTHS)  # the items (samples) of the step
    assert is_packed_batch(batch) and packs_sequences(DataCollatorWithFlattening())


def test_a_cache_turns_the_packed_mask_off_and_the_proof_sees_it():
    model, batch = tiny_llama("sdpa"), packed_batch()
    model.config.use_cache = True  # transformers then builds no per-sequence mask
    message = packing_leak(model, batch)
    assert message and message.startswith("LlamaForCausalLM would attend across the sequences")
    message, fix = packing_refusal(model, use_cache=True)
    assert "use_cache is on" in message and "use_cache: false" in fix


def test_models_that_would_mix_the_sequences_are_refused_with_the_reason():
    class NoPositions(nn.Module):
        def forward(self, input_ids, labels=None): ...

    class OwnAttention(nn.Module):
        def forward(self, input_ids, position_ids=None, labels=None): ...

    class Declared(OwnAttention):
        supports_packed_sequences = True

    message, _ = packing_refusal(NoPositions())
    assert (
        message.endswith("reach its attention")
        and "NoPositions would attend" in message
        and "takes no position_ids" in message
    )
    message, fix = packing_refusal(OwnAttention())
    assert "no transformers model" in message and "supports_packed_sequences" in message
    assert "CausalLMCollator" in fix
    assert packing_refusal(Declared()) is None
    message, _ = packing_refusal(tiny_llama("sdpa"), batch_keys=["input_ids", "attention_mask"])
    assert "attention_mask" in message
    message, _ = packing_refusal(tiny_llama("sdpa"), trainer_reason="the trainer cannot")
    assert message.endswith("the trainer cannot")


PACKED_CONFIG = """\
-- extends 'configs/lm.yaml'
-- block collator
data_collator: &data_collator !singleton:transformers:DataCollatorWithFlattening {}
-- endblock
"""


def test_dry_run_refuses_a_model_that_would_mix_packed_sequences(tmp_path):
    project = write_project(tmp_path / "plain")
    (project / "templates" / "configs" / "packed.yaml").write_text(PACKED_CONFIG)
    result = run_forge("train", "packed", "-p", str(project), "--dry-run", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "model.py:TinyLM would attend across the sequences of a packed batch" in result.stderr
    assert "its forward takes no position_ids" in result.stderr
    assert "DataCollatorWithFlattening" in result.stderr
    assert not (project / "output" / "packed").exists()


def test_dry_run_refuses_use_cache_with_packing():
    result = run_forge(
        "train", "-p", str(TINY_LM), *defines(SMALL_LM), "-D", "padding_free=true",
        "--set", "trainer.args.use_cache=true", "--dry-run", timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "LlamaForCausalLM would attend across the sequences" in result.stderr
    assert "set trainer.args.use_cache: false" in result.stderr


def test_a_packed_run_trains_and_counts_its_sequences(tmp_path):
    project = shutil.copytree(
        TINY_LM, tmp_path / "tiny_lm", ignore=shutil.ignore_patterns("output")
    )
    steps = 40
    result = run_forge(
        "train", "-p", str(project), *defines(SMALL_LM), "-D", "padding_free=true",
        "-D", f"max_steps={steps}", "-D", "logging_steps=10", "-D", f"save_steps={steps}",
        "-D", f"eval_steps={steps}", "-D", "report_to=none", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics_file,) = (project / "output").glob("train/run_*/metrics.jsonl")
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "learning_rate" in r]
    assert len(losses) == steps // 10 and losses[-1] < losses[0] - 0.5, losses
    (summary,) = [r for r in records if "train_samples_per_second" in r]
    per_step = summary["train_samples_per_second"] / summary["train_steps_per_second"]
    assert per_step == pytest.approx(16, rel=0.01)  # the batch's sequences, not its one row


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("job", ["1", "2", "fsdp", "hsdp", "accelerate"])
def test_a_packed_run_killed_with_sigkill_resumes_bit_identical(tmp_path, job):
    """The flattening collator keeps no state: a packed run killed after a checkpoint and
    continued with `forge resume` ends with the weights and optimizer state of the same run
    trained straight (1 and 2 processes; 2 under FSDP, 4 under HSDP as 2 replicas x 2
    shards, 2 with the Accelerate trainer)."""
    from forge.checkpoint import read_manifest
    from tests.integration.strategies import STRATEGIES, assert_same_end, sigkill_and_resume

    project = shutil.copytree(
        TINY_LM, tmp_path / "tiny_lm", ignore=shutil.ignore_patterns("output")
    )
    extra = [
        "-p", str(project), *defines(SMALL_LM), "-D", "padding_free=true", "-D", "max_steps=12",
        "-D", "save_steps=4", "-D", "eval_steps=12", "-D", "logging_steps=4",
        "-D", "report_to=none", *STRATEGIES.get(job, ["--nproc", job]),
    ]  # fmt: skip
    straight, resumed, _ = sigkill_and_resume(extra, project, saved=4, last=12)
    assert_same_end(straight, resumed)
    scope = read_manifest(resumed).components["optimizer"]["scope"]
    assert scope == ("sharded" if job.endswith("sdp") else "stage")
