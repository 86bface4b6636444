"""The pipeline trainer in one process: splitting, building a stage alone, the checks that run
before training, and training (one process holds every stage) exactly like the plain trainer."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from forge.data import CausalLMCollator
from forge.train import (
    PipelineTrainer,
    PipelineTrainingArguments,
    Trainer,
    TrainingArgumentsError,
)
from forge.train.pipeline.split import (
    ModelParts,
    SplitError,
    StageModule,
    prune_to_stages,
    split_layers,
)
from forge.train.pipeline.stage_init import build_partial_model
from tests.train.common import (
    StopAfterSave,
    TokenDataset,
    assert_same_tensors,
    checkpoint_dir,
    make_args,
    make_trainer,
    tiny_llama_config,
)
from tests.train.pipeline_script import llama_init

PARTS = ModelParts()
KEY = "trainer.args"


def pipeline_args(output_dir, **overrides) -> PipelineTrainingArguments:
    """make_args' small defaults, as PipelineTrainingArguments."""
    return PipelineTrainingArguments(**{**make_args(output_dir).to_dict(), **overrides})


def step_losses(output_dir) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


# ---------------------------------------------------------------------------------- splitting


def test_layers_split_evenly_or_where_the_config_says():
    even = split_layers(5, 2, None, PARTS, KEY)
    assert [list(s.layers) for s in even] == [[0, 1, 2], [3, 4]]
    assert even[0].module_names(PARTS) == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.rotary_emb",
    ]
    assert even[1].module_names(PARTS)[-3:] == ["model.norm", "lm_head", "model.rotary_emb"]
    named = split_layers(5, 3, ["model.layers.1", "model.layers.4"], PARTS, KEY)
    assert [list(s.layers) for s in named] == [[0], [1, 2, 3], [4]]


@pytest.mark.parametrize(
    ("stages", "split", "expected"),
    [
        (2, ["model.layer.2"], "'model.layer.2' is not a layer where a stage can begin"),
        (2, ["model.layers.4"], "use one of 'model.layers.1' ... 'model.layers.3'"),
        (3, ["model.layers.3", "model.layers.1"], "must be in increasing order"),
        (3, ["model.layers.2"], "names 1 stage start(s) for 3 stages"),
        (5, None, "5 pipeline stages but the model has only 4 layers"),
    ],
)
def test_a_split_that_does_not_fit_is_named(stages, split, expected):
    with pytest.raises(SplitError) as info:
        split_layers(4, stages, split, PARTS, KEY)
    assert expected in str(info.value)


def test_a_misnamed_part_is_reported_with_a_suggestion():
    with torch.device("meta"):
        model = llama_init()()
    (problem,) = ModelParts(embedding="model.embed").problems(model, KEY)
    assert problem.startswith(
        "trainer.args.pipeline_embedding: LlamaForCausalLM has no module 'model.embed' (name "
        "its token embedding); did you mean 'model.embed_tokens'"
    )
    uncovered = ModelParts(head=("lm_head",)).problems(model, KEY)
    assert "parameters in 'model.norm', which no stage would hold" in uncovered[0]


# ---------------------------------------------------------------------------------- one stage


@pytest.mark.parametrize(
    "kept_layers", [[0, 1], [2, 3], [1, 2], [3]], ids=["first", "last", "middle", "last-one"]
)
def test_a_stage_built_alone_has_the_unsplit_models_weights(kept_layers):
    """Built on meta with only its modules materialised, each stage's weights equal the whole
    model's from the same seed (tied embedding included), and the generator ends where the
    whole model's construction leaves it."""
    init = llama_init()
    torch.manual_seed(7)
    whole = init().state_dict()
    after_whole = torch.get_rng_state()
    specs = [s for s in split_layers(4, 4, None, PARTS, KEY) if s.index in kept_layers]
    kept = [n for s in specs for n in s.module_names(PARTS)]

    torch.manual_seed(7)
    stage = build_partial_model(init, kept)
    assert torch.equal(torch.get_rng_state(), after_whole)
    prune_to_stages(stage, PARTS, specs)
    state = stage.state_dict()
    assert not any(t.is_meta for t in state.values())
    layers = {int(k.split(".")[2]) for k in state if k.startswith("model.layers.")}
    assert layers == set(kept_layers)  # the other layers are gone, not merely empty
    for name, tensor in state.items():
        assert torch.equal(tensor, whole[name]), name
    if any(s.last for s in specs):  # the head keeps its tie to the embedding
        assert stage.lm_head.weight is stage.model.embed_tokens.weight


class HeadFromConstructor(LlamaForCausalLM):
    """A Hugging Face model whose _init_weights leaves the output head to its constructor."""

    def _init_weights(self, module):
        if module is not getattr(self, "lm_head", None):
            super()._init_weights(module)


def test_a_weight_only_the_constructor_sets_is_still_the_whole_models():
    """The replayed initialisation cannot set it, so the stage is built whole and pruned."""
    config = tiny_llama_config()  # untied: lm_head has its own weight
    init = functools.partial(HeadFromConstructor, config)
    torch.manual_seed(5)
    whole = init().state_dict()
    (last,) = [s for s in split_layers(2, 2, None, PARTS, KEY) if s.last]
    torch.manual_seed(5)
    stage = build_partial_model(init, last.module_names(PARTS))
    prune_to_stages(stage, PARTS, [last])
    assert "lm_head.weight" in stage.state_dict()
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, whole[name]), name


class TinyNet(nn.Module):
    """A model that is not a Hugging Face one: initialised in its constructors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 32)


def test_a_stage_of_any_module_has_the_whole_models_weights():
    parts = ModelParts(embedding="embed", layers="blocks", head=("out",), rotary=None)
    torch.manual_seed(3)
    whole = TinyNet().state_dict()
    (spec,) = [s for s in split_layers(3, 2, ["blocks.2"], parts, KEY) if s.last]
    torch.manual_seed(3)
    stage = build_partial_model(TinyNet, spec.module_names(parts))
    prune_to_stages(stage, parts, [spec])
    assert sorted(stage.state_dict()) == [
        "blocks.2.bias",
        "blocks.2.weight",
        "out.bias",
        "out.weight",
    ]
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, whole[name]), name
    assert StageModule(stage, parts, spec)(torch.randn(2, 8)).shape == (2, 32)


def test_the_stages_chained_compute_the_models_logits():
    init = llama_init()
    torch.manual_seed(0)
    model = init().eval()
    ids = torch.randint(3, 128, (2, 16))
    specs = split_layers(4, 3, None, PARTS, KEY)
    prune_to_stages(model, PARTS, specs)  # every stage in one model: nothing is removed
    hidden = ids
    with torch.no_grad():
        for spec in specs:
            hidden = StageModule(model, PARTS, spec)(hidden)
        torch.manual_seed(0)
        expected = init().eval()(input_ids=ids).logits
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------- arguments


def test_arguments_that_cannot_fit_are_reported_before_training(tmp_path):
    with pytest.raises(TrainingArgumentsError) as info:
        pipeline_args(
            tmp_path,
            per_device_train_batch_size=6,
            pipeline_microbatches=4,
            pipeline_schedule="interleaved_1f1b",
            fp16=True,
        )
    text = str(info.value)
    assert "per_device_train_batch_size 6 is not a multiple of pipeline_microbatches 4" in text
    assert "interleaved_1f1b runs several stages per process; set pipeline_stages_per_rank" in text
    assert "trainer.args.fp16 is not supported by the pipeline trainer; use bf16" in text
    with pytest.raises(TrainingArgumentsError, match="fewer than the 4 pipeline stages"):
        pipeline_args(tmp_path, pipeline_parallel_size=4, pipeline_microbatches=2)
    with pytest.raises(TrainingArgumentsError, match="pipeline_schedule must be one of"):
        pipeline_args(tmp_path, pipeline_schedule="zero_bubble")
    args = pipeline_args(tmp_path, pipeline_split=["model.layers.2"], pipeline_head="lm_head")
    assert args.pipeline_split == ("model.layers.2",) and args.pipeline_head == ("lm_head",)


def as_rank(monkeypatch, world_size: int, rank: int = 0) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))


@pytest.mark.parametrize(
    ("world", "overrides", "expected"),
    [
        (2, {"pipeline_split": ["model.layers.7"]}, "'model.layers.7' is not a layer where"),
        (4, {}, "4 pipeline stages but the model has only 2 layers"),
        (3, {"pipeline_parallel_size": 2}, "pipeline_parallel_size 2 does not divide the 3"),
        (2, {"per_device_train_batch_size": 3}, "batch_size 3 is not a multiple of the 2"),
        (2, {"pipeline_layers": "model.blocks"}, "has no module 'model.blocks'"),
    ],
)
def test_the_trainer_refuses_a_split_that_cannot_run_before_any_process_group(
    monkeypatch, tmp_path, world, overrides, expected
):
    """Every rank builds the trainer and raises the same error: no rank waits for another."""
    as_rank(monkeypatch, world)
    with pytest.raises(TrainingArgumentsError) as info:
        make_trainer(pipeline_args(tmp_path, **overrides), trainer_cls=PipelineTrainer)
    assert expected in str(info.value)
    assert not torch.distributed.is_initialized()


# ---------------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    "overrides",
    [{}, {"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 2}],
    ids=["one-stage", "two-stages-in-one-process"],
)
def test_in_one_process_it_trains_exactly_like_the_plain_trainer(tmp_path, overrides):
    config = tiny_llama_config()
    config.attention_dropout = 0.0  # microbatches would draw other dropout masks
    data = dict(train_dataset=TokenDataset(64), data_collator=CausalLMCollator(pad_token_id=0))
    common = dict(max_steps=6, gradient_accumulation_steps=2, logging_steps=1)
    plain = Trainer(
        functools.partial(LlamaForCausalLM, config), make_args(tmp_path / "plain", **common), **data
    )
    plain.train()
    args = pipeline_args(tmp_path / "pipe", **common, **overrides)  # 1 microbatch: same sums
    pipe = PipelineTrainer(functools.partial(LlamaForCausalLM, config), args, **data)
    pipe.train()
    assert step_losses(tmp_path / "pipe") == step_losses(tmp_path / "plain")
    for name, tensor in pipe.stage_state_dict().items():
        assert torch.equal(tensor, plain.model.state_dict()[name]), name


class Ragged(TokenDataset):
    """Rows of 4..16 tokens: right-padded batches hold different numbers of label tokens."""

    def __getitem__(self, index):
        return {"input_ids": self.ids[index][: 4 + index % 13]}


def test_it_evaluates_through_the_shared_evaluator_like_the_plain_trainer(tmp_path, caplog):
    """The pipeline trainer's evaluation is the evaluator every trainer uses, through its
    forward_eval seam: the same eval_loss as the plain trainer (per label token, over batches
    of different token counts), and compute_metrics named as not run."""
    config = tiny_llama_config()
    config.attention_dropout = 0.0
    data = dict(
        train_dataset=TokenDataset(32),
        eval_dataset=Ragged(23, seed=3),
        data_collator=CausalLMCollator(pad_token_id=0),
        compute_metrics=lambda prediction: {"never": 1.0},
    )
    common = dict(max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=5)
    plain = Trainer(
        functools.partial(LlamaForCausalLM, config), make_args(tmp_path / "plain", **common), **data
    ).train()
    args = pipeline_args(tmp_path / "pipe", **common)
    pipe = PipelineTrainer(functools.partial(LlamaForCausalLM, config), args, **data).train()
    assert pipe.metrics["eval_loss"] == pytest.approx(plain.metrics["eval_loss"], rel=1e-5)
    assert "eval_never" in plain.metrics and "eval_never" not in pipe.metrics
    assert "compute_metrics is not run by the pipeline trainer" in caplog.text
    assert "evaluation_loop" not in PipelineTrainer.__dict__  # no copy of the loop


def test_a_stage_checkpoint_resumes_exactly_and_loads_into_the_plain_trainer(tmp_path):
    """Stop at step 4 (a checkpoint), resume to 8: the same weights and optimizer as straight;
    the plain trainer then resumes from the pipeline trainer's checkpoint."""
    common = dict(max_steps=8, save_strategy="steps", save_steps=4, pipeline_microbatches=2)
    straight = make_trainer(pipeline_args(tmp_path / "a", **common), trainer_cls=PipelineTrainer)
    straight.train()
    first = make_trainer(
        pipeline_args(tmp_path / "b", **common, async_save=False),
        trainer_cls=PipelineTrainer,
        callbacks=[StopAfterSave(4)],
    )
    first.train()
    assert first.state.global_step == 4
    resumed = make_trainer(pipeline_args(tmp_path / "b", **common), trainer_cls=PipelineTrainer)
    resumed.train(resume_from_checkpoint=True)
    assert_same_tensors(straight.stage_state_dict(), resumed.stage_state_dict(), "weights")
    assert_same_tensors(
        straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"], "optim"
    )
    plain = make_trainer(make_args(tmp_path / "c", max_steps=5, save_strategy="no"))
    plain.train(resume_from_checkpoint=checkpoint_dir(tmp_path / "b", 4))
    assert plain.state.global_step == 5


def test_batches_the_stages_cannot_pass_on_are_refused(tmp_path):
    trainer = make_trainer(
        pipeline_args(tmp_path, max_steps=1, pipeline_microbatches=2), trainer_cls=PipelineTrainer
    )
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="cannot pass on \\['token_type_ids'\\]"):
        trainer.strategy.inputs({"input_ids": ids, "labels": ids, "token_type_ids": ids})
    left_padded = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="pads on the left"):
        trainer.strategy.inputs({"input_ids": ids, "labels": ids, "attention_mask": left_padded})
    right_padded = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    trainer.strategy.inputs({"input_ids": ids, "labels": ids, "attention_mask": right_padded})


def test_label_smoothing_is_the_last_stages_loss_as_in_the_plain_trainer(tmp_path):
    config = tiny_llama_config()
    config.attention_dropout = 0.0  # microbatches would draw other dropout masks
    data = dict(train_dataset=TokenDataset(64), data_collator=CausalLMCollator(pad_token_id=0))
    common = dict(max_steps=4, logging_steps=1, label_smoothing_factor=0.2)
    plain = Trainer(
        functools.partial(LlamaForCausalLM, config), make_args(tmp_path / "plain", **common), **data
    )
    plain.train()
    pipe = PipelineTrainer(
        functools.partial(LlamaForCausalLM, config),
        pipeline_args(tmp_path / "pipe", **common),
        **data,
    )
    pipe.train()
    unsmoothed = Trainer(
        functools.partial(LlamaForCausalLM, config),
        make_args(tmp_path / "none", max_steps=4, logging_steps=1),
        **data,
    )
    unsmoothed.train()
    assert step_losses(tmp_path / "pipe") == step_losses(tmp_path / "plain")
    assert step_losses(tmp_path / "pipe") != step_losses(tmp_path / "none")


def test_what_would_change_the_loss_and_cannot_is_refused_when_built(tmp_path):
    class OwnLoss(PipelineTrainer):
        def compute_loss(self, model, batch, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, batch, return_outputs, num_items_in_batch)

    with pytest.raises(TrainingArgumentsError, match="OwnLoss overrides compute_loss, which"):
        make_trainer(pipeline_args(tmp_path, max_steps=1), trainer_cls=OwnLoss)
    with pytest.raises(TrainingArgumentsError, match="smooth the labels inside loss_fn"):
        make_trainer(
            pipeline_args(tmp_path, max_steps=1, label_smoothing_factor=0.1),
            trainer_cls=PipelineTrainer,
            loss_fn=lambda logits, labels: logits.mean(),
        )


def test_activation_checkpointing_wraps_the_stages_layers_and_trains_the_same(tmp_path):
    """The stage's layers are checkpointed by forge (not HF's switch, which needs the embedding
    a later stage lacks); dropout on, the losses and weights equal those without."""
    common = dict(max_steps=4, logging_steps=1, pipeline_microbatches=2)
    plain = make_trainer(pipeline_args(tmp_path / "a", **common), trainer_cls=PipelineTrainer)
    plain.train()
    ac = make_trainer(
        pipeline_args(tmp_path / "b", activation_checkpointing=True, **common),
        trainer_cls=PipelineTrainer,
    )
    ac.train()
    layers = ac.model.model.layers
    assert all("forward" in vars(layer) for layer in layers.values())
    assert not any(layer.gradient_checkpointing for layer in layers.values())
    assert step_losses(tmp_path / "b") == step_losses(tmp_path / "a")
    assert_same_tensors(plain.stage_state_dict(), ac.stage_state_dict(), "weights")


def test_named_blocks_are_checked_against_the_whole_model_when_built(tmp_path):
    args = pipeline_args(tmp_path, max_steps=1, activation_checkpointing_modules=["model.layer"])
    with pytest.raises(TrainingArgumentsError, match="did you mean 'model.layers'"):
        make_trainer(args, trainer_cls=PipelineTrainer)
    with pytest.raises(TrainingArgumentsError, match="did you mean 'model.layers'"):
        PipelineTrainer.plan_job(llama_init(), args, world_size=2)  # before forge launches
