"""LoRA fine-tuning (peft): adapter-only checkpoints, the base stored once, exact resume, a
changed base refused, merged export, target-module detection and its refusals."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from forge.checkpoint import CheckpointError, validate_checkpoint
from forge.checkpoint.adapter import BaseChanged
from forge.data import CausalLMCollator
from forge.read.errors import ReadUsageError
from forge.read.reader import export_model
from forge.train import AccelTrainer, AccelTrainingArguments, Trainer, TrainingArgumentsError
from forge.train.lora import LoraUsageError, default_target_modules, load_base_model
from tests.train.common import (
    VOCAB,
    StopAfterSave,
    TokenDataset,
    assert_same_training,
    checkpoint_dir,
    make_args,
    make_trainer,
    tiny_llama_config,
)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face directory: the base every LoRA run here tunes."""
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("base") / "llama"
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    return directory


def lora(**overrides):
    values = dict(r=4, lora_alpha=8, lora_dropout=0.1, task_type="CAUSAL_LM")
    values.update(overrides)
    return LoraConfig(**values)


def lora_trainer(output_dir, base, peft_config=None, trainer_cls=Trainer, **overrides):
    values = dict(max_steps=8, save_strategy="steps", save_steps=2, logging_steps=2)
    values.update(overrides)
    callbacks = values.pop("callbacks", ())
    model = (
        functools.partial(load_base_model, str(base)) if not callable(base) else base
    )  # a directory, or a builder of a model that is on no disk
    args = make_args(output_dir, **values)
    if trainer_cls is not Trainer:
        args = AccelTrainingArguments(**args.to_dict())
    return trainer_cls(
        model,
        args,
        TokenDataset(64),
        data_collator=CausalLMCollator(pad_token_id=0),
        peft_config=peft_config or lora(),
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_dir):
    out = tmp_path_factory.mktemp("lora")
    trainer = lora_trainer(out, base_dir)
    trainer.train()
    return out, trainer


def test_checkpoints_hold_only_the_adapter_and_its_optimizer_state(trained, base_dir):
    out, trainer = trained
    ckpt = checkpoint_dir(out, 8)
    assert validate_checkpoint(ckpt) == []
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names)
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    # detected targets: every attention and MLP projection of the Llama
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    trained_names = {
        k.removeprefix("state.").rsplit(".", 1)[0] for k in optimizer if k.startswith("state.")
    }
    assert trained_names and all("lora_" in name for name in trained_names)
    assert trained_names == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    # peft loads the checkpoint as it is, onto the base, to the same adapter weights
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), ckpt
    ).eval()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=0, rtol=0
        )


def test_a_base_on_disk_is_referenced_once_with_its_hash(trained, base_dir):
    out, _ = trained
    record = json.loads((out / "base_model.json").read_text())
    assert record["path"] == str(base_dir.resolve()) and record["copied"] is False
    assert len(record["sha256"]) == 64
    assert not (out / "base_model").exists()  # referenced, not copied
    manifest = json.loads((checkpoint_dir(out, 4) / "manifest.json").read_text())
    assert manifest["lora_base"] == record


def test_resume_is_bit_exact(trained, base_dir, tmp_path):
    _, straight = trained
    out = tmp_path / "run"
    lora_trainer(out, base_dir, callbacks=[StopAfterSave(4)], async_save=False).train()
    assert not checkpoint_dir(out, 6).exists()
    resumed = lora_trainer(out, base_dir)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.resumed_from == str(checkpoint_dir(out, 4))
    assert_same_training(straight, resumed)


def test_the_accelerate_trainer_saves_the_adapter_and_resumes_exactly(trained, base_dir, tmp_path):
    _, straight = trained
    out = tmp_path / "run"
    lora_trainer(
        out, base_dir, trainer_cls=AccelTrainer, callbacks=[StopAfterSave(4)], async_save=False
    ).train()
    names = {p.name for p in checkpoint_dir(out, 4).iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    resumed = lora_trainer(out, base_dir, trainer_cls=AccelTrainer)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(straight, resumed)


def test_a_resume_whose_base_changed_on_disk_is_refused(tmp_path):
    torch.manual_seed(0)
    base = tmp_path / "base"
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(base)
    out = tmp_path / "run"
    lora_trainer(out, base, max_steps=2).train()
    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BaseChanged, match=str(base.resolve())) as info:
        lora_trainer(out, base, max_steps=4).train(resume_from_checkpoint=True)
    assert "changed on disk" in str(info.value)
    assert not checkpoint_dir(out, 4).exists()


def test_a_target_that_matches_nothing_is_refused_naming_the_layers(tmp_path, base_dir):
    trainer = lora_trainer(tmp_path, base_dir, peft_config=lora(target_modules=["qq_proj"]))
    with pytest.raises(TrainingArgumentsError) as info:
        trainer.train()
    message = str(info.value)
    assert "trainer.peft_config.target_modules" in message and "'qq_proj'" in message
    assert "q_proj" in message and "down_proj" in message  # the names there are
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "base_model.json").exists()


def test_merged_export_loads_without_peft_and_gives_the_same_logits(trained, base_dir, tmp_path):
    out, _ = trained
    ckpt = checkpoint_dir(out, 8)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export_model(ckpt, merged, merge_lora=True)
    export_model(ckpt, adapter)
    assert not (merged / "adapter_config.json").exists()
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert type(plain) is LlamaForCausalLM
    through_peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), adapter
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, through_peft(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_merge_lora_is_refused_for_a_checkpoint_without_an_adapter(tmp_path):
    make_trainer(make_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1)).train()
    with pytest.raises(ReadUsageError, match="--merge-lora"):
        export_model(checkpoint_dir(tmp_path, 1), tmp_path / "out", merge_lora=True)


def test_a_base_built_in_memory_is_written_once_into_the_run(tmp_path):
    """GPT-2 (transformers' config, random weights): a model forge was not built around, and
    a base on no disk, so the run keeps a copy of it in base_model/."""
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64)
    trainer = lora_trainer(tmp_path, functools.partial(GPT2LMHeadModel, config), max_steps=4)
    trainer.train()
    record = json.loads((tmp_path / "base_model.json").read_text())
    assert record["copied"] is True and record["path"] == str((tmp_path / "base_model").resolve())
    ckpt = checkpoint_dir(tmp_path, 4)
    assert set(json.loads((ckpt / "adapter_config.json").read_text())["target_modules"]) == {
        "c_attn", "c_proj", "c_fc"
    }  # fmt: skip
    merged = tmp_path / "merged"
    export_model(ckpt, merged, merge_lora=True)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    plain = GPT2LMHeadModel.from_pretrained(merged).eval()
    base = GPT2LMHeadModel.from_pretrained(tmp_path / "base_model")
    through_peft = PeftModel.from_pretrained(base, ckpt).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, through_peft(input_ids=ids).logits, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            lambda: LlamaForCausalLM(tiny_llama_config()),
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        (
            lambda: GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB)),
            ["c_attn", "c_proj", "c_fc"],
        ),
        (
            lambda: BertModel(
                BertConfig(
                    hidden_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=32,
                    vocab_size=VOCAB,
                )  # fmt: skip
            ),
            ["query", "key", "value", "dense"],
        ),
        (
            lambda: T5ForConditionalGeneration(
                T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=VOCAB)
            ),
            ["q", "k", "v", "o", "wi", "wo"],
        ),
        (
            lambda: OPTForCausalLM(
                OPTConfig(
                    hidden_size=16,
                    ffn_dim=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    vocab_size=VOCAB,
                    word_embed_proj_dim=16,
                )  # fmt: skip
            ),
            ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
        ),
    ],
    ids=["llama", "gpt2", "bert", "t5", "opt"],
)
def test_default_targets_are_the_attention_and_mlp_projections(model, expected):
    assert default_target_modules(model()) == expected


def test_a_model_of_no_known_family_must_name_its_targets():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(TrainingArgumentsError, match="lora_target_modules"):
        default_target_modules(model)


def test_lora_under_fsdp_is_refused_at_construction_naming_ddp(tmp_path):
    from forge.train import Trainer

    args = make_args(tmp_path, fsdp="full_shard")
    with pytest.raises(
        TrainingArgumentsError, match="peft_config: LoRA is not supported under fsdp"
    ):
        Trainer(
            functools.partial(LlamaForCausalLM, tiny_llama_config()),
            args,
            TokenDataset(8),
            peft_config=lora(),
        )


def test_a_quantised_base_is_refused_without_a_gpu(base_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LoraUsageError, match="needs a CUDA GPU"):
        load_base_model(base_dir, load_in_4bit=True)


def test_a_base_that_is_no_model_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such"):
        load_base_model(tmp_path / "missing")
    with pytest.raises(LoraUsageError, match="-D base_model=PATH"):
        load_base_model(None)


def test_a_base_that_is_a_module_of_ones_own_names_the_route_for_it(tmp_path):
    from forge.checkpoint import CheckpointWriter

    with CheckpointWriter(tmp_path, 4) as writer:  # a checkpoint of a module: no config.json
        writer.save_safetensors("model.safetensors", {"head.weight": torch.zeros(2, 2)})
    with pytest.raises(LoraUsageError) as info:
        load_base_model(writer.final_path)
    assert "keep the config's own model block" in str(info.value)
    assert "== lora.peft_config()" in str(info.value)
    assert "'LoRA on a module of your own'" in str(info.value)


def test_a_base_directory_is_the_one_that_loads(base_dir):
    model = load_base_model(base_dir)
    assert isinstance(model, LlamaForCausalLM)
    assert model.name_or_path == str(base_dir.resolve())


def test_a_lora_checkpoint_as_base_is_its_base_with_the_adapter_merged(trained):
    out, trainer = trained
    model = load_base_model(checkpoint_dir(out, 8))
    assert type(model) is LlamaForCausalLM and model.name_or_path == ""  # on no disk as such
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_a_moving_average_with_lora_covers_the_adapter_and_resumes_exactly(base_dir, tmp_path):
    """ema_decay on a LoRA run: the average holds the trainable (adapter) parameters only, is
    saved beside the adapter, and a resumed run ends with the straight run's average."""
    from forge.train.ema import read_ema_state

    straight = lora_trainer(tmp_path / "straight", base_dir, ema_decay=0.9)
    straight.train()
    average = read_ema_state(checkpoint_dir(tmp_path / "straight", 8))
    trainable = {n for n, p in straight.model.named_parameters() if p.requires_grad}
    assert set(average) == trainable and all("lora_" in name for name in average)
    # it moved: peft starts every lora_B at zero
    assert any(average[n].abs().sum() > 0 for n in average if "lora_B" in n)
    out = tmp_path / "run"
    lora_trainer(
        out, base_dir, ema_decay=0.9, callbacks=[StopAfterSave(4)], async_save=False
    ).train()
    lora_trainer(out, base_dir, ema_decay=0.9).train(resume_from_checkpoint=True)
    resumed = read_ema_state(checkpoint_dir(out, 8))
    assert all(torch.equal(average[name], resumed[name]) for name in average)


def test_an_async_save_writes_the_same_adapter_checkpoints(trained, base_dir, tmp_path):
    out, _ = trained
    lora_trainer(tmp_path / "async", base_dir, async_save=True).train()
    for step in (4, 8):
        ckpt = checkpoint_dir(tmp_path / "async", step)
        assert validate_checkpoint(ckpt) == []
        mine = load_file(ckpt / "adapter_model.safetensors")
        theirs = load_file(checkpoint_dir(out, step) / "adapter_model.safetensors")
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_merge_lora_ema_merges_the_adapters_moving_average(base_dir, tmp_path):
    """The best checkpoint of a run that evaluates its average is chosen by the average:
    `forge export --merge-lora --ema` writes the base with that average merged in."""
    from forge.train.ema import read_ema_state

    lora_trainer(tmp_path / "run", base_dir, ema_decay=0.9, max_steps=4, save_steps=4).train()
    ckpt = checkpoint_dir(tmp_path / "run", 4)
    average = read_ema_state(ckpt)
    export_model(ckpt, tmp_path / "ema", merge_lora=True, ema=True)
    export_model(ckpt, tmp_path / "trained", merge_lora=True)
    oracle = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), ckpt)
    with torch.no_grad():
        for name, param in oracle.named_parameters():
            if name in average:
                param.copy_(average[name])
    expected = oracle.merge_and_unload().state_dict()
    got = load_file(tmp_path / "ema" / "model.safetensors")
    assert all(torch.equal(got[name], expected[name]) for name in got)
    trained = load_file(tmp_path / "trained" / "model.safetensors")
    assert any(not torch.equal(got[name], trained[name]) for name in got)
    with pytest.raises(
        ReadUsageError, match="add --merge-lora to export the base with the average"
    ):
        export_model(ckpt, tmp_path / "adapter", ema=True)
    export_model(ckpt, tmp_path / "adapter")  # its config names the base it belongs to
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())


def test_a_relative_base_model_is_the_projects_and_the_run_records_it_whole(tmp_path, monkeypatch):
    from forge.config import load_project, render_config
    from tests.helpers import TINY_LM

    monkeypatch.chdir(tmp_path)  # started elsewhere: the path is still the project's
    project = load_project(TINY_LM)
    text = render_config(project, "lora.yaml", {"base_model": "output/train/run_001"}).text
    expected = json.dumps(str(TINY_LM / "output" / "train" / "run_001"))
    assert f"path: {expected}" in text and f"- {expected}" in text
    absolute = render_config(project, "lora.yaml", {"base_model": str(tmp_path)}).text
    assert f"path: {json.dumps(str(tmp_path))}" in absolute
