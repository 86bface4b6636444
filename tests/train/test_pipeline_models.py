"""The pipeline trainer on models forge was not built around: each Hugging Face family's preset,
chosen from the model class, splits it into stages whose chained forward is the unsplit
model's; parts named in the config (several modules for one part); models that cannot be
split are refused at construction with the reason; a module kept on a stage only for a tied
weight holds no tensor without data."""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
import transformers as hf
from torch import nn

from forge.data import CausalLMCollator
from forge.train import (
    PipelineTrainer,
    PipelineTrainingArguments,
    Trainer,
    TrainingArgumentsError,
)
from forge.train.pipeline.plan import plan_pipeline
from forge.train.pipeline.split import StageModule, prune_to_stages
from forge.train.pipeline.stage_init import build_partial_model
from tests.train.common import VOCAB, TokenDataset, make_args
from tests.train.pipeline_script import gpt2_init

KEY = "trainer.args"
SMALL = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64)

# Four layers, no dropout; sliding windows (Mistral, Qwen2's upper layers, GPT-Neo's local
# layers) shorter than the 12-token test sequences, so a wrong mask changes the logits.
FAMILIES = {
    "gpt2": lambda: gpt2_init().args[0],
    "gpt_neo": lambda: hf.GPTNeoConfig(
        num_layers=4, hidden_size=32, num_heads=4, max_position_embeddings=64,
        attention_types=[[["global", "local"], 2]], window_size=4,
        resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0,
    ),
    "gpt_neox": lambda: hf.GPTNeoXConfig(
        num_hidden_layers=4, max_position_embeddings=64, **SMALL
    ),
    "opt": lambda: hf.OPTConfig(
        num_hidden_layers=4, hidden_size=32, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, word_embed_proj_dim=16, dropout=0.0,
    ),  # word_embed_proj_dim < hidden_size: project_in and project_out exist
    "llama": lambda: hf.LlamaConfig(num_hidden_layers=4, max_position_embeddings=64, **SMALL),
    "mistral": lambda: hf.MistralConfig(
        num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=4, **SMALL,
    ),
    "qwen2": lambda: hf.Qwen2Config(
        num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=4, max_window_layers=2, **SMALL,
    ),
    "gemma": lambda: hf.GemmaConfig(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        **SMALL,
    ),  # scales its embeddings (inside its embedding module)
    "phi": lambda: hf.PhiConfig(num_hidden_layers=4, max_position_embeddings=64, **SMALL),
    "bert": lambda: hf.BertConfig(
        num_hidden_layers=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **SMALL,
    ),
}  # fmt: skip
CLASSES = {
    "gpt2": hf.GPT2LMHeadModel,
    "gpt_neo": hf.GPTNeoForCausalLM,
    "gpt_neox": hf.GPTNeoXForCausalLM,
    "opt": hf.OPTForCausalLM,
    "llama": hf.LlamaForCausalLM,
    "mistral": hf.MistralForCausalLM,
    "qwen2": hf.Qwen2ForCausalLM,
    "gemma": hf.GemmaForCausalLM,
    "phi": hf.PhiForCausalLM,
    "bert": hf.BertForMaskedLM,
}


def family_init(name: str, attention: str = "eager") -> functools.partial:
    config = FAMILIES[name]()
    config.vocab_size = VOCAB
    config._attn_implementation = attention
    return functools.partial(CLASSES[name], config)


def step_losses(output_dir) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def pipeline_args(tmp_path, **overrides) -> PipelineTrainingArguments:
    return PipelineTrainingArguments(**{**make_args(tmp_path).to_dict(), **overrides})


def four_stages(tmp_path, **overrides) -> PipelineTrainingArguments:
    """Four stages of one layer each, two per process (the plan of a 2-process job)."""
    return pipeline_args(
        tmp_path, pipeline_schedule="interleaved_1f1b", pipeline_stages_per_rank=2, **overrides
    )


def skeleton(init) -> nn.Module:
    with torch.device("meta"):
        return init()


# eager attention takes the mask the stage builds (sdpa may take none and attend causally)
@pytest.mark.parametrize("attention", ["eager", pytest.param("sdpa", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_splits_from_its_preset_into_stages_that_compute_its_logits(
    tmp_path, family, attention
):
    """Each stage built alone (as a worker builds it, from the same seed), chained: the unsplit
    model's logits, to the bit."""
    if family == "gpt_neo" and attention == "sdpa":
        pytest.skip("GPT-Neo has no sdpa attention")
    init = family_init(family, attention)
    plan = plan_pipeline(skeleton(init), four_stages(tmp_path), world_size=2)
    parts = plan.layout.parts
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    with torch.no_grad():
        expected = init().eval()(input_ids=ids).logits
        hidden = ids
        for spec in plan.layout.stages:
            torch.manual_seed(0)
            stage = build_partial_model(init, spec.module_names(parts))
            prune_to_stages(stage, parts, [spec])
            assert not any(t.is_meta for t in [*stage.parameters(), *stage.buffers()])
            with warnings.catch_warnings(record=True) as raised:
                warnings.simplefilter("always")
                hidden = StageModule(stage, parts, spec).eval()(hidden)
            # the masks are built with the keywords the installed transformers names
            assert [str(w.message) for w in raised if w.category is FutureWarning] == []
    assert torch.equal(hidden, expected)


def test_gpt2s_preset_names_its_three_embedding_modules_and_its_tied_head(tmp_path):
    init = gpt2_init()
    plan = plan_pipeline(skeleton(init), pipeline_args(tmp_path), world_size=2)
    assert plan.describe() == [
        "pipeline: 2 stage(s) on 2 process(es) per replica x 1 replica(s); schedule 1f1b, "
        "2 microbatch(es) per batch",
        "  stage 0 (process 0): transformer.wte + transformer.wpe + transformer.drop + "
        "transformer.h.0-1",
        "  stage 1 (process 1): transformer.h.2-3 + transformer.ln_f + lm_head",
        "  shared across stages, gradients summed: transformer.wte.weight (processes 0, 1)",
    ]
    # stage 0 writes the tied embedding once; lm_head.weight names the same tensor
    assert plan.writer["transformer.wte.weight"] == 0 and "lm_head.weight" not in plan.writer


def test_the_last_stage_of_gpt2_built_alone_holds_the_head_tied_to_the_embedding():
    init = gpt2_init()
    torch.manual_seed(3)
    whole = init().state_dict()
    plan = plan_pipeline(skeleton(init), pipeline_args("/tmp/unused"), world_size=2)
    parts, last = plan.layout.parts, plan.layout.stages[-1]
    torch.manual_seed(3)
    stage = build_partial_model(init, last.module_names(parts))
    prune_to_stages(stage, parts, [last])
    assert stage.lm_head.weight is stage.transformer.wte.weight
    assert stage.transformer.wpe is None and stage.transformer.drop is None
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, whole[name]), name
    stage.to("cpu")  # nothing left on the meta device


class MyGPT(hf.GPT2LMHeadModel):
    """A user's subclass of a known class: it keeps the class's preset."""


def test_the_preset_comes_from_the_class_hierarchy_and_config_keys_replace_its_names(tmp_path):
    init = functools.partial(MyGPT, gpt2_init().args[0])
    plan = plan_pipeline(skeleton(init), pipeline_args(tmp_path), world_size=2)
    assert plan.layout.parts.embedding[0] == "transformer.wte"
    args = pipeline_args(tmp_path, pipeline_head="transformer.ln_f")  # lm_head left out
    with pytest.raises(TrainingArgumentsError, match="no stage would hold"):
        plan_pipeline(skeleton(init), args, world_size=2)


class Blocks(nn.Module):
    """No known family: token and learned position embeddings, dropout, blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(64, 16)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.drop(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))
        for block in self.blocks:
            hidden = block(hidden)
        return self.out(hidden)


def test_a_model_of_no_known_family_names_its_parts_and_may_give_several_embeddings(tmp_path):
    with pytest.raises(TrainingArgumentsError) as info:
        plan_pipeline(skeleton(Blocks), pipeline_args(tmp_path), world_size=2)
    (problem,) = info.value.problems
    assert problem.startswith("trainer.args: forge knows no preset for Blocks")
    assert "pipeline_embedding, pipeline_layers, pipeline_head" in problem
    assert "its layers look like 'blocks'" in problem
    args = pipeline_args(
        tmp_path,
        pipeline_embedding=["tok", "pos", "drop"],  # a position embedding: added
        pipeline_layers="blocks",
        pipeline_head=["out"],
    )
    plan = plan_pipeline(skeleton(Blocks), args, world_size=2)
    torch.manual_seed(0)
    model = Blocks().eval()
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        expected = model(ids)
        prune_to_stages(model, plan.layout.parts, plan.layout.stages)
        hidden = ids
        for spec in plan.layout.stages:
            hidden = StageModule(model, plan.layout.parts, spec)(hidden)
    assert torch.equal(hidden, expected)


class Embedder(nn.Module):
    """A user's wrapper of the token and position embeddings, as one part."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1]))


class WrappedTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedder(nn.Embedding(VOCAB, 16), nn.Embedding(64, 16))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.embed.tok.weight  # tied: the head lives on the last stage


def test_a_part_kept_on_a_stage_only_for_a_tied_weight_holds_no_tensor_without_data(tmp_path):
    """The last stage keeps the embedding wrapper for the head's tied weight; its position
    embedding, which no stage there runs, is dropped, so moving the stage to its device works
    (it used to fail: "Cannot copy out of meta tensor")."""
    args = pipeline_args(
        tmp_path, pipeline_embedding="embed", pipeline_layers="blocks", pipeline_head="out"
    )
    plan = plan_pipeline(skeleton(WrappedTied), args, world_size=2)
    parts, last = plan.layout.parts, plan.layout.stages[-1]
    torch.manual_seed(1)
    whole = WrappedTied()
    torch.manual_seed(1)
    stage = build_partial_model(WrappedTied, last.module_names(parts))
    prune_to_stages(stage, parts, [last])
    stage.to("cpu")
    assert sorted(stage.state_dict()) == [
        "blocks.1.0.bias",
        "blocks.1.0.weight",
        "embed.tok.weight",
        "out.weight",
    ]
    assert stage.out.weight is stage.embed.tok.weight
    assert torch.equal(stage.out.weight, whole.out.weight)
    assert plan.shared == {"embed.tok.weight": [0, 1]}


class Alibi(nn.Module):
    def forward(self, hidden_states, alibi, attention_mask=None):
        return hidden_states


def test_models_that_cannot_be_split_are_refused_with_the_reason(tmp_path):
    args = pipeline_args(tmp_path)
    opt = FAMILIES["opt"]()
    opt.layerdrop = 0.1
    mixtral = hf.MixtralConfig(
        num_hidden_layers=2, num_local_experts=2, output_router_logits=True, **SMALL
    )
    t5 = hf.T5Config(num_layers=2, d_model=16, d_ff=32, num_heads=2, d_kv=8)
    cases = [
        (hf.OPTForCausalLM(opt), "its forward skips layers at random (config.layerdrop 0.1)"),
        (hf.MixtralForCausalLM(mixtral), "its forward adds the router's auxiliary loss"),
        (hf.T5ForConditionalGeneration(t5), "it is an encoder-decoder model"),
    ]
    for model, reason in cases:
        with pytest.raises(TrainingArgumentsError) as info:
            plan_pipeline(model.to("meta"), args, world_size=2)
        assert f"{type(model).__name__} cannot be split into pipeline stages: {reason}" in str(
            info.value
        )
    falcon = hf.FalconForCausalLM(
        hf.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    )
    named = pipeline_args(
        tmp_path,
        pipeline_embedding="transformer.word_embeddings",
        pipeline_layers="transformer.h",
        pipeline_head=["transformer.ln_f", "lm_head"],
        pipeline_rotary="transformer.rotary_emb",
    )
    with pytest.raises(TrainingArgumentsError) as info:
        plan_pipeline(falcon.to("meta"), named, world_size=2)
    assert "FalconDecoderLayer.forward needs 'alibi', which a pipeline stage does not give" in str(
        info.value
    )


def test_gpt2_in_one_process_trains_exactly_like_the_plain_trainer(tmp_path):
    """Two stages in one process (its tied embedding and head in one model): the same losses
    and weights as the plain trainer, step for step."""
    data = dict(train_dataset=TokenDataset(64), data_collator=CausalLMCollator(pad_token_id=0))
    common = dict(max_steps=4, gradient_accumulation_steps=2, logging_steps=1)
    plain = Trainer(gpt2_init(), make_args(tmp_path / "plain", **common), **data)
    plain.train()
    args = four_stages(tmp_path / "pipe", pipeline_microbatches=1, **common)
    pipe = PipelineTrainer(gpt2_init(), args, **data)
    pipe.train()
    assert pipe.plan.layout.parts.embedding == (
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
    )
    assert step_losses(tmp_path / "pipe") == step_losses(tmp_path / "plain")
    for name, tensor in pipe.stage_state_dict().items():
        assert torch.equal(tensor, plain.model.state_dict()[name]), name


class MaskedTokens(TokenDataset):
    """Items with masked-LM labels (every third position ignored) and no attention mask."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        labels = ids.clone()
        labels[::3] = -100
        return {"input_ids": ids, "labels": labels}


def test_a_bert_masked_lm_in_one_process_trains_exactly_like_the_plain_trainer(tmp_path):
    """An encoder from its preset (no causal mask), on batches without an attention mask."""
    common = dict(max_steps=4, logging_steps=1)
    plain = Trainer(family_init("bert"), make_args(tmp_path / "plain", **common), MaskedTokens(64))
    plain.train()
    args = four_stages(tmp_path / "pipe", pipeline_microbatches=1, **common)
    pipe = PipelineTrainer(family_init("bert"), args, MaskedTokens(64))
    pipe.train()
    assert step_losses(tmp_path / "pipe") == step_losses(tmp_path / "plain")
    assert len(set(step_losses(tmp_path / "plain"))) == 4


def test_an_encoders_stages_refuse_padded_batches(tmp_path):
    """An encoder's layers see every position: without the padding mask, padding would change
    the other tokens' outputs, so such a batch is refused."""
    init = family_init("bert")
    args = pipeline_args(tmp_path, max_steps=1, pipeline_microbatches=2)
    trainer = PipelineTrainer(init, args, train_dataset=TokenDataset(8))
    ids = torch.ones(2, 4, dtype=torch.long)
    padded = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="encoder attend to every position"):
        trainer.strategy.inputs({"input_ids": ids, "labels": ids, "attention_mask": padded})
    trainer.strategy.inputs(
        {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    )
