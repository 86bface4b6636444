"""LoRA on the pipeline trainer: each stage adapts its own layers under the names a one-process
LoRA run gives them, only the adapter trains, and the checkpoint is one adapter file like a
one-process run's (gathered from the stages, written by rank 0), which the plain trainer
continues and ``forge export --merge-lora`` merges. Splits LoRA cannot train are refused."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from forge.read.reader import export_model
from forge.train import PipelineTrainer, PipelineTrainingArguments, TrainingArgumentsError
from forge.train.lora import LoraUsageError, split_problems
from forge.train.pipeline.plan import plan_pipeline
from tests.train.common import TokenDataset, run_torchrun, tiny_llama_config
from tests.train.pipeline_lora_script import STEPS, trainer

SCRIPT = Path(__file__).with_name("pipeline_lora_script.py")


def tied_llama(device: str = "meta") -> LlamaForCausalLM:
    config = tiny_llama_config()
    config.num_hidden_layers = 4
    config.attention_dropout = 0.0
    config.tie_word_embeddings = True  # the first and last stages share it
    with torch.device(device):
        return LlamaForCausalLM(config)


def held(model, stages: int = 2):
    args = PipelineTrainingArguments(output_dir="unused", per_device_train_batch_size=2)
    return plan_pipeline(model, args, stages).held_modules(model)


def test_a_split_whose_stages_each_hold_a_target_is_accepted():
    model = tied_llama()
    assert split_problems(model, LoraConfig(r=4), held(model)) == []
    assert split_problems(model, LoraConfig(r=4, target_modules=["q_proj"]), held(model)) == []


def test_a_target_two_stages_hold_is_refused_naming_it_and_why():
    model = tied_llama()  # the last stage holds the embedding for the head tied to it
    config = LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"])
    (problem,) = split_problems(model, config, held(model))
    assert "trainer.peft_config.target_modules: 'model.embed_tokens'" in problem
    assert "stages 0 and 1" in problem and "tie_word_embeddings: false" in problem


def test_a_stage_with_nothing_to_adapt_is_refused():
    model = tied_llama()
    config = LoraConfig(r=4, target_modules=["lm_head"])
    (problem,) = split_problems(model, config, held(model))
    assert "pipeline stage(s) 0 hold none of the modules LoRA adapts" in problem
    assert "'lm_head'" in problem


def test_lora_on_pipeline_x_fsdp_is_refused_at_construction(tmp_path):
    args = PipelineTrainingArguments(output_dir=str(tmp_path), report_to="none", fsdp="full_shard")
    with pytest.raises(TrainingArgumentsError, match="peft_config: LoRA is not supported under"):
        PipelineTrainer(
            functools.partial(LlamaForCausalLM, tiny_llama_config()),
            args,
            TokenDataset(8),
            peft_config=LoraConfig(r=4),
        )


def test_a_base_built_in_memory_is_refused_naming_base_model(tmp_path):
    args = PipelineTrainingArguments(output_dir=str(tmp_path), report_to="none", max_steps=1)
    trainer = PipelineTrainer(
        functools.partial(LlamaForCausalLM, tiny_llama_config()),
        args,
        TokenDataset(8),
        peft_config=LoraConfig(r=4),
    )
    with pytest.raises(LoraUsageError, match=r"base_model=PATH.*each stage holds only its own"):
        trainer.train()
    assert not (tmp_path / "base_model").exists()  # nothing written for the run


# ------------------------------------------------------------------- 2 stages on 2 processes


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("base") / "llama"
    tied_llama(device="cpu").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def runs(base_dir, tmp_path_factory):
    """The same LoRA run on 2 pipeline stages (torchrun, gloo) and in one process."""
    pipeline, plain = tmp_path_factory.mktemp("pipeline"), tmp_path_factory.mktemp("plain")
    run_torchrun(SCRIPT, str(pipeline), "pipeline", str(base_dir), "{}", nproc=2, timeout=900)
    trainer(plain, "plain", base_dir).train()
    return pipeline, plain


def losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def checkpoint(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"checkpoint-{step:06d}"


@pytest.mark.slow
def test_two_stages_train_the_adapter_like_one_process(runs):
    pipeline, plain = runs
    piped, whole = losses(pipeline), losses(plain)
    assert sorted(piped) == sorted(whole) == list(range(1, STEPS + 1))
    assert [piped[s] for s in whole] == pytest.approx(list(whole.values()), rel=1e-5, abs=1e-6)
    assert len(set(whole.values())) == STEPS  # the adapter trains: the comparison is not vacuous
    ckpt = checkpoint(pipeline, STEPS)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["components"]["model"]["files"] == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert not list(ckpt.glob("model*.safetensors"))  # never the frozen base
    stages, one = (
        load_file(ckpt / "adapter_model.safetensors"),
        load_file(checkpoint(plain, STEPS) / "adapter_model.safetensors"),
    )
    assert sorted(stages) == sorted(one)  # every stage's layers, under one process's names
    assert any(".layers.0." in k for k in stages) and any(".layers.3." in k for k in stages)
    for name, tensor in one.items():
        torch.testing.assert_close(stages[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_the_plain_trainer_continues_a_pipeline_lora_checkpoint(runs, tmp_path):
    pipeline, plain = runs
    continued = trainer(
        tmp_path, "plain", json.loads((pipeline / "base_model.json").read_text())["path"]
    )
    continued.train(resume_from_checkpoint=str(checkpoint(pipeline, 4)))
    after, whole = losses(tmp_path), losses(plain)
    assert sorted(after) == [5, 6]
    assert [after[s] for s in (5, 6)] == pytest.approx([whole[5], whole[6]], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_merge_lora_exports_a_pipeline_checkpoint_as_one_process_s(runs, tmp_path):
    pipeline, plain = runs
    merged = {}
    for name, run in (("pipeline", pipeline), ("plain", plain)):
        export_model(checkpoint(run, STEPS), tmp_path / name, merge_lora=True)
        assert not (tmp_path / name / "adapter_config.json").exists()
        merged[name] = LlamaForCausalLM.from_pretrained(tmp_path / name).eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            merged["pipeline"](input_ids=ids).logits,
            merged["plain"](input_ids=ids).logits,
            atol=1e-4,
            rtol=0,
        )
