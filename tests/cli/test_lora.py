"""tiny_lm's lora.yaml through the real entry point: a trained tiny_lm fine-tuned with LoRA,
its checkpoints a fraction of the base, used by generate / evaluate / predict / export as they
are, listed and verified as any other, and a resume refused once its base changed on disk."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli.small_lm import SMALL_LM, defines
from tests.helpers import REPO, run_forge

TRAINING = {"logging_steps": 2, "eval_steps": 2, "report_to": "none", "save_total_limit": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    project = tmp_path_factory.mktemp("p") / "tiny_lm"
    shutil.copytree(REPO / "projects" / "tiny_lm", project, ignore=shutil.ignore_patterns("output"))
    small = defines(SMALL_LM | TRAINING)
    base = run_forge("train", "-p", str(project), *small, "-D", "max_steps=2", "-D", "save_steps=2")
    assert base.returncode == 0, base.stderr
    base_run = project / "output" / "train" / "run_001"
    data = {k: SMALL_LM[k] for k in ("block_size", "max_files")}  # the model is the base's
    tuned = run_forge(
        "train", "lora.yaml", "-p", str(project), *defines(data | TRAINING),
        "-D", f"base_model={base_run}",
        "-D", "max_steps=10", "-D", "save_steps=2",
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr
    return project, base_run, project / "output" / "lora" / "run_001"


@pytest.mark.slow  # shares a ~35 s fixture; tests/train/test_lora.py covers it in process
def test_the_base_is_referenced_once_and_checkpoints_hold_the_adapter(runs):
    _, base_run, run = runs
    base_ckpt = base_run / "checkpoints" / "checkpoint-000002"
    record = json.loads((run / "base_model.json").read_text())
    assert record["path"] == str(base_ckpt.resolve()) and not record["copied"]
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert [c.name for c in checkpoints][-1] == "checkpoint-000010"
    assert len(checkpoints) <= 4  # rotation: save_total_limit 3, and the best kept
    for ckpt in checkpoints:
        assert (ckpt / "adapter_model.safetensors").is_file()
        assert not (ckpt / "model.safetensors").exists()
    result = run_forge("checkpoints", "-p", str(runs[0]), "--verify")
    assert result.returncode == 0, result.stderr
    assert "lora/run_001/checkpoints/checkpoint-000010" in result.stdout
    assert "invalid" not in result.stdout
    listed = run_forge("runs", "-p", str(runs[0]))
    assert "lora/run_001" in listed.stdout and "lora.yaml" in listed.stdout
    assert json.loads((run / "run.json").read_text())["best"]["metric"] == "eval_loss"


@pytest.mark.slow  # shares a ~35 s fixture; tests/train/test_lora.py covers it in process
def test_generate_evaluate_and_predict_use_a_lora_checkpoint(runs, tmp_path):
    _, _, run = runs
    ckpt = run / "checkpoints" / "checkpoint-000010"
    generated = run_forge("generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "5")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("def")
    evaluated = run_forge("evaluate", str(run), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    metrics = json.loads(evaluated.stdout)
    assert metrics["checkpoint"] == str(ckpt) and metrics["eval_loss"] > 0
    history = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    assert metrics["eval_loss"] == pytest.approx(history[-1]["eval_loss"], rel=1e-4)
    inputs, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text('{"text": "import "}\n')
    predicted = run_forge(
        "predict", str(ckpt), "--input", str(inputs), "--output", str(output),
        "--max-new-tokens", "4",
    )  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    assert "prediction" in json.loads(output.read_text())


@pytest.mark.slow  # shares a ~35 s fixture; tests/train/test_lora.py covers it in process
def test_a_target_that_matches_nothing_is_refused_before_the_run_starts(runs):
    project, base_run, _ = runs
    data = {k: SMALL_LM[k] for k in ("block_size", "max_files")}
    result = run_forge(
        "train", "lora.yaml", "-p", str(project), *defines(data | TRAINING),
        "-D", f"base_model={base_run}", "-D", "lora_target_modules=[q_proj, qq_proj]",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "trainers/lora.yaml:" in result.stderr  # located at the line that names them
    assert "no module named 'qq_proj'; did you mean 'q_proj'" in result.stderr
    assert "gate_proj" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (project / "output" / "lora").iterdir()) == ["run_001"]


@pytest.mark.slow  # shares a ~35 s fixture; tests/train/test_lora.py covers it in process
def test_export_merge_lora_and_refusals(runs, tmp_path):
    _, base_run, run = runs
    ckpt = run / "checkpoints" / "checkpoint-000010"
    merged = run_forge("export", str(ckpt), str(tmp_path / "merged"), "--merge-lora")
    assert merged.returncode == 0, merged.stderr
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    refused = run_forge("export", str(base_run), str(tmp_path / "x"), "--merge-lora")
    assert refused.returncode == 2
    assert "holds no adapter" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.slow  # shares a ~35 s fixture; tests/train/test_lora.py covers it in process
def test_a_resume_whose_base_changed_is_refused_naming_it(runs):
    project, base_run, run = runs
    base_ckpt = (base_run / "checkpoints" / "checkpoint-000002").resolve()
    weights = base_ckpt / "model.safetensors"
    original = weights.read_bytes()
    try:  # same size, other values: the base checkpoint's sizes still check
        weights.write_bytes(original[:-4] + bytes(b ^ 0x55 for b in original[-4:]))
        result = run_forge("resume", "-p", str(project), "--run-dir", str(run), "--set",
                           "trainer.args.max_steps=12")  # fmt: skip
    finally:
        weights.write_bytes(original)
    assert result.returncode != 0
    assert "changed on disk" in result.stderr and str(base_ckpt) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (run / "checkpoints" / "checkpoint-000012").exists()


def test_the_checkpoint_is_a_small_fraction_of_the_tiny_lm_base(tmp_path):
    """tiny_lm's own model (the project's sizes) with lora.yaml's defaults: ten checkpoints
    cost the base once plus ten adapters."""
    import functools

    import torch
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge.config import load_config, load_project
    from forge.data import CausalLMCollator
    from forge.train import Trainer
    from forge.train.lora import load_base_model
    from tests.train.common import TokenDataset, make_args

    cfg = load_config(load_project(REPO / "projects" / "tiny_lm"), "train")
    sizes = {k: v for k, v in cfg.targets[".model_config"].kwargs.items() if k != "vocab_size"}
    lora = load_config(load_project(REPO / "projects" / "tiny_lm"), "lora")
    lora_kwargs = lora.targets["trainer"].kwargs["peft_config"].kwargs
    torch.manual_seed(0)
    base = tmp_path / "base"
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, **sizes)).save_pretrained(base)
    out = tmp_path / "run"
    args = make_args(out, max_steps=10, save_strategy="steps", save_steps=1)
    Trainer(
        functools.partial(load_base_model, str(base)),
        args,
        TokenDataset(64),
        data_collator=CausalLMCollator(pad_token_id=0),
        peft_config=LoraConfig(**lora_kwargs),
    ).train()
    base_bytes = sum(p.stat().st_size for p in base.iterdir())
    checkpoints = sorted((out / "checkpoints").iterdir())
    assert len(checkpoints) == 10
    for ckpt in checkpoints:
        adapter = (ckpt / "adapter_model.safetensors").stat().st_size
        total = sum(p.stat().st_size for p in ckpt.iterdir())
        assert adapter < 0.08 * base_bytes
        assert total < 0.25 * base_bytes  # adapter, its optimizer moments, the loop's state
    everything = base_bytes + sum(p.stat().st_size for c in checkpoints for p in c.iterdir())
    assert everything < 3.5 * base_bytes  # ten full checkpoints would be over 30x


@pytest.mark.slow
def test_two_processes_train_and_resume_a_lora_run(runs):
    """DDP (torchrun, gloo): each rank holds the base; rank 0 records it and writes the
    adapter, and the run resumes with both ranks."""
    project, base_run, _ = runs
    data = {k: SMALL_LM[k] for k in ("block_size", "max_files")}
    trained = run_forge(
        "train", "lora.yaml", "-p", str(project), "--nproc", "2", *defines(data | TRAINING),
        "-D", f"base_model={base_run}", "-D", "max_steps=4", "-D", "save_steps=2",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    run = project / "output" / "lora" / "run_002"
    names = {p.name for p in (run / "checkpoints" / "checkpoint-000004").iterdir()}
    assert {"adapter_model.safetensors", "data-rank-00001.pt"} <= names
    assert "model.safetensors" not in names
    resumed = run_forge(
        "resume", "-p", str(project), "--run-dir", str(run), "--nproc", "2",
        "--set", "trainer.args.max_steps=6",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert (run / "checkpoints" / "checkpoint-000006" / "adapter_model.safetensors").is_file()
