"""forge export: one Hugging Face model directory from a checkpoint of any layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from forge.checkpoint import CheckpointWriter
from forge.read.errors import ReadFailure, ReadUsageError
from forge.read.reader import CheckpointReader, export_model
from tests.train.common import tiny_llama_config


@pytest.fixture
def model() -> LlamaForCausalLM:
    """The tiny Llama with its output head tied to the embedding, as tiny_lm's is."""
    config = tiny_llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def whole_checkpoint(model, root, **save):
    """A checkpoint as the plain trainer writes it (save_pretrained), with training state."""
    with CheckpointWriter(root, 1) as writer:
        writer.save_model(model, **save)
        writer.save_torch("optimizer.pt", {"state": {}})
    return writer.final_path


def stage_checkpoint(model, root):
    """A checkpoint as two pipeline stages write it: a shard each, an index, the config."""
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    first = {k: v for k, v in state.items() if k.startswith(("model.embed", "model.layers.0"))}
    last = {k: v for k, v in state.items() if k not in first}
    names = [f"model-stage-{k:05d}-of-00002.safetensors" for k in range(2)]
    with CheckpointWriter(root, 1) as writer:
        writer.save_safetensors(names[0], first)
        writer.save_safetensors(names[1], last)
        writer.index_weights(names)
        model.config.save_pretrained(writer.path)
        writer.save_torch("optimizer-stage-00000-of-00002.pt", {"state": {}})
    return writer.final_path


def exported_tensors(out) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    tensors = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(out / name))
    return tensors


@pytest.mark.parametrize("layout", ["whole", "stages"])
def test_export_holds_the_checkpoints_tensors_and_loads_with_from_pretrained(
    model, tmp_path, layout
):
    make = whole_checkpoint if layout == "whole" else stage_checkpoint
    ckpt = make(model, tmp_path / "ckpt")
    out = tmp_path / "out"
    assert export_model(ckpt, out) == ckpt
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]  # no state
    tensors = exported_tensors(out)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_large_model_is_sharded_as_save_pretrained_shards_it(model, tmp_path):
    ckpt = whole_checkpoint(model, tmp_path / "ckpt")
    export_model(ckpt, tmp_path / "out", max_shard_size="20KB")
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    tensors = exported_tensors(out)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_non_empty_output_is_refused_without_force(model, tmp_path):
    ckpt = whole_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ReadUsageError, match="exists and is not empty; .* pass --force"):
        export_model(ckpt, out)
    assert (out / "notes.txt").read_text() == "keep me"
    export_model(ckpt, out, force=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def strict_load(module, out):
    """``module`` given an export's state dict with ``load_state_dict(strict=True)``."""
    module.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    return module


@pytest.mark.parametrize("shard", [None, "2KB"])
def test_a_plain_module_exports_its_state_dict_that_loads_strictly(tmp_path, shard):
    """A module that is no transformers model has no Hugging Face form: its export is its
    state dict, tied weights under each of their names, buffers too, so load_state_dict with
    strict=True takes it (past --max-shard-size, huggingface_hub.load_torch_model)."""
    from huggingface_hub import load_torch_model

    from tests.checkpoint.checkpoint_helpers import TinyNet

    torch.manual_seed(0)
    net = TinyNet()
    ckpt = whole_checkpoint(net, tmp_path / "ckpt")
    out = tmp_path / "out"
    export_model(ckpt, out, **({"max_shard_size": shard} if shard else {}))
    assert not (out / "config.json").exists() and not list(out.glob("*.pt"))
    fresh = TinyNet()
    if shard is None:
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
        strict_load(fresh, out)
    else:
        assert (out / "model.safetensors.index.json").is_file()
        load_torch_model(fresh, out, strict=True)
    for name, tensor in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    with pytest.raises(ReadUsageError, match="holds no transformers model"):
        export_model(ckpt, tmp_path / "sub", submodule="body")


def wrapper_checkpoint(wrapper, root, layout):
    """A checkpoint of a wrapper model as the plain trainer (one stage) or two pipeline stages
    write it: the weights under the wrapper's names, through the model component."""
    from forge.checkpoint import ModelWeights, stage_weights_name

    weights = ModelWeights(wrapper)
    with CheckpointWriter(root, 1) as writer:
        if layout == "whole":
            weights.write(writer, weights.state_dict(), None)
        else:
            state = {k: v for k, v in wrapper.state_dict().items() if k != "lm.lm_head.weight"}
            names = [stage_weights_name(k, 2) for k in range(2)]
            first = {
                k: v
                for k, v in state.items()
                if k.startswith(("lm.transformer.wte", "lm.transformer.wpe", "lm.transformer.h.0"))
            }
            weights.write(writer, first, names[0])
            weights.write(writer, {k: v for k, v in state.items() if k not in first}, names[1])
            writer.index_weights(names)
    return writer.final_path


def gpt2_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("layout", ["whole", "stages"])
def test_a_wrapper_exports_the_transformers_model_it_holds(tmp_path, layout):
    from tests.checkpoint.checkpoint_helpers import LMWrapper, tiny_gpt2

    wrapper = LMWrapper(tiny_gpt2())  # carries the GPT-2's config as its own `config`
    ckpt = wrapper_checkpoint(wrapper, tmp_path / "ckpt", layout)
    assert not (ckpt / "config.json").exists()  # its names are the wrapper's, not GPT-2's
    out = tmp_path / "out"
    export_model(ckpt, out)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, 96, (2, 10))
    assert torch.equal(gpt2_logits(loaded.eval(), ids), gpt2_logits(wrapper.lm, ids))


def test_a_wrapper_with_weights_of_its_own_exports_its_model_only_when_asked(tmp_path):
    from tests.checkpoint.checkpoint_helpers import LMWrapper, tiny_gpt2

    wrapper = LMWrapper(tiny_gpt2(), head=True)
    ckpt = wrapper_checkpoint(wrapper, tmp_path / "ckpt", "whole")
    with pytest.raises(ReadUsageError) as refused:  # it needs --submodule: exit 2
        export_model(ckpt, tmp_path / "out")
    message = str(refused.value)
    assert "holds a GPT2LMHeadModel as 'lm' and weights outside it" in message
    assert "value_head.bias, value_head.weight" in message and "--submodule lm" in message
    assert not (tmp_path / "out").exists()
    export_model(ckpt, tmp_path / "out", submodule="lm")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 96, (1, 8))
    assert torch.equal(gpt2_logits(loaded, ids), gpt2_logits(wrapper.lm, ids))
    with pytest.raises(ReadUsageError, match="no weights under 'head'"):
        export_model(ckpt, tmp_path / "other", submodule="head")


def test_a_config_json_that_does_not_name_the_weights_is_refused(model, tmp_path):
    from tests.checkpoint.checkpoint_helpers import tiny_gpt2

    ckpt = tmp_path / "ckpt"  # a directory another tool wrote: GPT-2's config, Llama's weights
    model.save_pretrained(ckpt)
    tiny_gpt2().config.save_pretrained(ckpt)
    with pytest.raises(ReadFailure) as refused:
        export_model(ckpt, tmp_path / "out")
    message = str(refused.value)
    assert "its config describes a GPT2LMHeadModel, but the checkpoint's weights are not" in (
        message
    )
    assert "missing lm_head.weight, transformer.h.0.attn" in message
    assert "not GPT2LMHeadModel's: model.embed_tokens.weight" in message
    assert not (tmp_path / "out").exists()


def test_an_older_wrapper_checkpoint_with_its_inner_config_exports_that_model(tmp_path):
    from forge.checkpoint import stage_weights_name
    from tests.checkpoint.checkpoint_helpers import LMWrapper, tiny_gpt2

    wrapper = LMWrapper(tiny_gpt2())
    ckpt = tmp_path / "ckpt"  # as the pipeline trainer wrote it before: wrapper names + config
    ckpt.mkdir()
    state = {k: v for k, v in wrapper.state_dict().items() if k != "lm.lm_head.weight"}
    from forge.checkpoint.io import save_tensors, write_weights_index

    save_tensors(ckpt / stage_weights_name(0, 1), state, None)
    write_weights_index(ckpt, [stage_weights_name(0, 1)])
    wrapper.config.save_pretrained(ckpt)
    export_model(ckpt, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 96, (1, 8))
    assert torch.equal(gpt2_logits(loaded, ids), gpt2_logits(wrapper.lm, ids))


# ---------------------------------------------------------------------------------------------
# a model of the user's own, trained with a moving average of its weights


EMA_OVERRIDES = ["trainer.args.ema_decay=0.9", "trainer.args.eval_with_ema=true"]


@pytest.fixture(scope="module")
def plain_ema_run(tmp_path_factory):
    from tests.plain_project import train_in_process, write_project

    root = write_project(tmp_path_factory.mktemp("plain") / "plain")
    return train_in_process(root, "lm", EMA_OVERRIDES)


def tiny_lm_class(run_dir):
    """The project's own TinyLM class, imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plain_export_model", run_dir.parents[2] / "model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TinyLM


def test_export_ema_of_a_plain_module_writes_its_average_as_a_state_dict(plain_ema_run, tmp_path):
    from forge.train.ema import read_ema_state

    ckpt = plain_ema_run / "checkpoints" / "checkpoint-000004"
    out = tmp_path / "ema"
    export_model(ckpt, out, ema=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    average = read_ema_state(ckpt)
    trained = load_file(ckpt / "model.safetensors")
    model = strict_load(tiny_lm_class(plain_ema_run)(vocab_size=trained["head.bias"].numel()), out)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), average[name]), name
        assert not torch.equal(param.detach(), trained[name]), name
    export_model(ckpt, tmp_path / "raw")  # without --ema: the trained weights
    raw = load_file(tmp_path / "raw" / "model.safetensors")
    assert raw.keys() == trained.keys()
    assert all(torch.equal(raw[name], trained[name]) for name in trained)


# ---------------------------------------------------------------------------------------------
# LoRA on a model of the user's own


LORA_CONFIG = """\
-- extends 'configs/lm.yaml'
-- block trainer
    == super()
    peft_config: !singleton:peft:LoraConfig
        r: 4
        target_modules: [head]
-- endblock
"""


# the same, the module given through a LossAdapter (its names are the module's own)
ADAPTED_LORA_CONFIG = """\
-- extends 'configs/lora.yaml'
-- block model
model: &model !partial:forge.train:LossAdapter
    module: !partial:./model.py:TinyLM
        vocab_size: !call:forge.data.vocab:vocab_size [*tokenizer]
-- endblock
"""


@pytest.fixture(scope="module")
def plain_lora_run(tmp_path_factory):
    from tests.plain_project import train_in_process, write_project

    root = write_project(tmp_path_factory.mktemp("plain") / "plain")
    (root / "templates" / "configs" / "lora.yaml").write_text(LORA_CONFIG)
    return train_in_process(root, "lora")


@pytest.fixture(scope="module")
def adapted_lora_run(tmp_path_factory):
    from tests.plain_project import train_in_process, write_project

    root = write_project(tmp_path_factory.mktemp("adapted") / "plain")
    (root / "templates" / "configs" / "lora.yaml").write_text(LORA_CONFIG)
    (root / "templates" / "configs" / "adapted.yaml").write_text(ADAPTED_LORA_CONFIG)
    return train_in_process(root, "adapted")


def base_with_adapter(run_dir, ckpt):
    """The oracle: the run's base, read from its base_model/ copy, with peft's adapter on it
    (not merged)."""
    from peft import PeftModel

    base = load_file(run_dir / "base_model" / "model.safetensors")
    model = tiny_lm_class(run_dir)(vocab_size=base["head.bias"].numel())
    model.load_state_dict(base, strict=True)
    return PeftModel.from_pretrained(model, ckpt).eval()


def test_merge_lora_of_a_plain_module_writes_the_merged_state_dict(plain_lora_run, tmp_path):
    ckpt = plain_lora_run / "checkpoints" / "checkpoint-000004"
    assert not (plain_lora_run / "base_model" / "config.json").exists()
    out = tmp_path / "merged"
    export_model(ckpt, out, merge_lora=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    oracle = base_with_adapter(plain_lora_run, ckpt)
    merged = strict_load(
        tiny_lm_class(plain_lora_run)(vocab_size=oracle.head.base_layer.out_features), out
    )
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        expected, got = oracle(input_ids=ids)["logits"], merged.eval()(input_ids=ids)["logits"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    base = load_file(plain_lora_run / "base_model" / "model.safetensors")
    assert not torch.equal(merged.head.weight, base["head.weight"])  # the adapter is in it
    # outside its run nothing builds the module: refused, saying why and what to do
    import shutil

    alone = shutil.copytree(ckpt, tmp_path / "alone" / "checkpoint-000004")
    with pytest.raises(ReadUsageError, match="is no Hugging Face model directory .* not inside a"):
        export_model(alone, tmp_path / "refused", merge_lora=True)
    assert not (tmp_path / "refused").exists()


def test_merge_lora_of_a_loss_adapted_module_writes_the_modules_own_names(
    adapted_lora_run, tmp_path
):
    ckpt = adapted_lora_run / "checkpoints" / "checkpoint-000004"
    out = tmp_path / "merged"
    export_model(ckpt, out, merge_lora=True)
    from peft import PeftModel

    from forge.train import LossAdapter

    base = load_file(adapted_lora_run / "base_model" / "model.safetensors")
    model = tiny_lm_class(adapted_lora_run)(vocab_size=base["head.bias"].numel())
    model.load_state_dict(base, strict=True)
    oracle = PeftModel.from_pretrained(LossAdapter(model), ckpt).eval()  # as it trained
    merged = strict_load(  # the user's module, not the LossAdapter around it
        tiny_lm_class(adapted_lora_run)(vocab_size=base["head.bias"].numel()), out
    )
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        expected, got = oracle(input_ids=ids)["logits"], merged.eval()(input_ids=ids)["logits"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the adapter's config names its base (peft would write null for a module built in memory)
    export_model(ckpt, tmp_path / "adapter")
    for directory in (ckpt, tmp_path / "adapter"):
        config = json.loads((directory / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(adapted_lora_run / "base_model")


def test_predict_and_generate_use_a_plain_modules_lora_checkpoint(plain_lora_run, tmp_path):
    from transformers import AutoTokenizer

    from forge.read.predict import continue_with_module

    ckpt = plain_lora_run / "checkpoints" / "checkpoint-000004"
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    oracle = base_with_adapter(plain_lora_run, ckpt)
    ids = tokenizer("def add", return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(continue_with_module(oracle, tokenizer, ids, 4, 0.0))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('"def add"\n')
    CheckpointReader(ckpt).predict(inputs, tmp_path / "out.jsonl", max_new_tokens=4)
    assert json.loads((tmp_path / "out.jsonl").read_text())["prediction"] == expected
    [text] = CheckpointReader(ckpt).generate("def add", max_new_tokens=4, temperature=0.0)
    assert text == tokenizer.decode(
        ids[0].tolist() + continue_with_module(oracle, tokenizer, ids, 4, 0.0)
    )


def test_forge_export_hands_the_checkpoint_down_once(model, tmp_path):
    """scripts/route.py over a real `forge export`: the checkpoint goes from the command to the
    read side and never comes back up to forge/cli (the issue's measure of the read side)."""
    import importlib.util

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("route", REPO / "scripts" / "route.py")
    route = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(route)
    ckpt = whole_checkpoint(model, tmp_path / "ckpt")
    figures = route.follow_export(ckpt, tmp_path / "out")
    path = figures["route"]
    assert path[:3] == ["forge.cli", "forge.cli.commands", "forge.read.reader"]
    assert not any(module.startswith("forge.cli") for module in path[2:])
    assert figures["climbs_to_cli"] == 0 and "forge.read.export" in path
    assert (tmp_path / "out" / "model.safetensors").is_file()
