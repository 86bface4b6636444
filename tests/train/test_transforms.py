"""The model-transform stage: activation checkpointing of any module (same gradients, names
unchanged, refused when a named block does not exist), Hugging Face's own switch, and the
order build -> checkpointing -> compile -> parallel wrap."""

from __future__ import annotations

import copy
import functools
import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM

from forge.data import CausalLMCollator
from forge.train import Trainer, TrainerCallback, TrainingArguments, TrainingArgumentsError
from forge.train.transforms import apply_activation_checkpointing, checkpointed_blocks
from tests.train.common import (
    VOCAB,
    TokenDataset,
    assert_same_tensors,
    make_args,
    make_trainer,
    tiny_llama_config,
)


class Block(nn.Module):
    """A residual block with dropout; counts its forward calls (a checkpointed block runs its
    forward again in the backward pass)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return hidden + self.dropout(torch.tanh(self.linear(hidden)))


class TinyLM(nn.Module):
    """A language model that is not a Hugging Face one: embedding, 3 blocks, head."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(self.norm(hidden))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def ac_args(**overrides) -> TrainingArguments:
    return TrainingArguments(output_dir="/tmp/unused", report_to="none", **overrides)


def forward_backward(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    model.train()
    model(input_ids=ids, labels=ids)["loss"].backward()
    return {name: p.grad for name, p in model.named_parameters()}


def recomputed(model: TinyLM) -> list[int]:
    """Which blocks ran their forward again in the backward pass (1) or not (0)."""
    for block in model.blocks:
        block.calls = 0
    forward_backward(model)
    return [block.calls - 1 for block in model.blocks]


# ------------------------------------------------------------------ any nn.Module


def test_checkpointed_blocks_give_the_same_gradients_and_keep_their_names():
    """Dropout included (the random state is kept for the recomputation): bit-equal
    gradients (torch.equal), the same parameter and state-dict names."""
    torch.manual_seed(0)
    plain = TinyLM()
    checkpointed = copy.deepcopy(plain)
    names = list(checkpointed.state_dict())
    described = apply_activation_checkpointing(checkpointed, ac_args(activation_checkpointing=True))
    assert described == "activation checkpointing: 3 of 3 blocks (blocks.0, blocks.1, blocks.2)"
    assert list(checkpointed.state_dict()) == names
    block = checkpointed.blocks[0]
    assert inspect.signature(block.forward) == inspect.signature(plain.blocks[0].forward)
    assert [n for n, _ in checkpointed.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]
    assert_same_tensors(forward_backward(plain), forward_backward(checkpointed), "grads")
    assert recomputed(checkpointed) == [1, 1, 1] and recomputed(plain) == [0, 0, 0]


@pytest.mark.parametrize(
    ("modules", "every", "expected"),
    [
        (["blocks.1"], 1, [0, 1, 0]),  # a module path
        (["blocks"], 2, [1, 0, 1]),  # a list: each child; every 2nd from layer 0 (as HF's)
        (["Block"], 3, [1, 0, 0]),  # a class name
        (["blocks", "blocks.2"], 1, [1, 1, 1]),  # a block inside a selected one: once
    ],
)
def test_named_blocks_and_every_kth(modules, every, expected):
    torch.manual_seed(0)
    model = TinyLM()
    args = ac_args(activation_checkpointing_modules=modules, activation_checkpointing_every=every)
    assert args.activation_checkpointing is True  # naming the blocks turns it on
    apply_activation_checkpointing(model, args)
    assert recomputed(model) == expected


def test_checkpointing_twice_does_not_nest():
    model = TinyLM()
    args = ac_args(activation_checkpointing=True)
    apply_activation_checkpointing(model, args)
    apply_activation_checkpointing(model, args)  # a second train() of the same module
    assert recomputed(model) == [1, 1, 1]


def test_the_default_blocks_are_the_list_holding_the_most_parameters():
    class Experts(nn.Module):
        """A block with a longer list inside (8 experts) than the model's 2 layers."""

        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    model = nn.Module()
    model.layers = nn.ModuleList(Experts() for _ in range(2))
    model.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # two classes: no blocks
    names = [name for name, _ in checkpointed_blocks(model, ac_args(), None)]
    assert names == ["layers.0", "layers.1"]


def test_the_default_blocks_are_every_stack_of_repeated_layers():
    """T5's encoder and decoder stacks hold blocks of one class (T5Block): both are its repeated
    layers, not only the larger. A list of plain layers beside the blocks (per-layer norms) is
    not; a model with nothing but such lists has them as its repeated layers."""
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
    )
    names = [name for name, _ in checkpointed_blocks(t5, ac_args(), None)]
    assert names == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]

    model = TinyLM(depth=2)
    model.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(2))
    assert [name for name, _ in checkpointed_blocks(model, ac_args(), None)] == [
        "blocks.0",
        "blocks.1",
    ]
    mlp = nn.Module()
    mlp.layers = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    assert len(checkpointed_blocks(mlp, ac_args(), None)) == 3


class Loop(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def tiny_lm_trainer(output_dir: Path, model=None, **overrides) -> Trainer:
    args = make_args(output_dir, max_steps=6, logging_steps=1, **overrides)
    return Trainer(
        model if model is not None else TinyLM,
        args,
        TokenDataset(32),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[Loop()],
    )


def logged_losses(output_dir: Path) -> list[float]:
    rows = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [row["loss"] for row in rows if "loss" in row and "train_runtime" not in row]


def test_the_trainer_trains_a_plain_module_the_same_with_activation_checkpointing(tmp_path):
    """gradient_checkpointing (HF's name) on a model without HF's switch: its repeated
    layers are checkpointed; the loss curve and the weights equal those without."""
    plain = tiny_lm_trainer(tmp_path / "plain")
    plain.train()
    checkpointed = tiny_lm_trainer(tmp_path / "ac", gradient_checkpointing=True)
    checkpointed.train()
    assert recomputed(checkpointed.model) == [1, 1, 1]
    assert logged_losses(tmp_path / "ac") == logged_losses(tmp_path / "plain")
    assert len(logged_losses(tmp_path / "ac")) == 6
    assert_same_tensors(plain.model.state_dict(), checkpointed.model.state_dict(), "weights")


def test_a_name_that_matches_no_module_is_refused_with_the_names_that_exist(tmp_path):
    with pytest.raises(TrainingArgumentsError) as given:  # a module: refused when built
        tiny_lm_trainer(tmp_path, model=TinyLM(), activation_checkpointing_modules=["block.1"])
    message = str(given.value)
    assert (
        "trainer.args.activation_checkpointing_modules: TinyLM has no module or module class "
        "'block.1'; did you mean 'blocks.1'" in message
    )
    assert "'blocks'" in message and "Block" in message  # the repeated layers, the classes

    built = tiny_lm_trainer(tmp_path, activation_checkpointing_modules=["Blocks"])
    with pytest.raises(TrainingArgumentsError, match="did you mean 'Block'"):
        built.train()  # a builder's model: refused when built, before the first step
    assert built.callback_handler.callbacks[-1].steps == 0


def test_a_model_without_repeated_layers_names_its_classes(tmp_path):
    model = nn.Module()
    model.proj = nn.Linear(4, 4)
    with pytest.raises(TrainingArgumentsError, match="Module has none. Name the blocks") as found:
        checkpointed_blocks(model, ac_args(activation_checkpointing=True), None)
    assert "Linear" in str(found.value)


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"activation_checkpointing_every": 0}, "activation_checkpointing_every must be"),
        ({"activation_checkpointing_modules": [""]}, "must be a list of module paths"),
        (
            {
                "activation_checkpointing_every": 2,
                "activation_checkpointing_kwargs": {"every_n_layers": 3},
            },
            "set activation_checkpointing_every only",
        ),
    ],
)
def test_activation_checkpointing_arguments_are_checked(values, problem):
    with pytest.raises(TrainingArgumentsError, match=problem):
        ac_args(**values)


def test_hf_5s_every_n_layers_keyword_is_activation_checkpointing_every():
    args = ac_args(
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": False},
    )
    assert args.activation_checkpointing_every == 2
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert ac_args(activation_checkpointing_modules="blocks").activation_checkpointing_modules == (
        "blocks",
    )


def test_forge_checkpoints_non_reentrantly():
    model = TinyLM()
    args = ac_args(
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}
    )
    with pytest.raises(TrainingArgumentsError, match="use_reentrant: true is for Hugging Face"):
        apply_activation_checkpointing(model, args)


# ------------------------------------------------------------------ Hugging Face models


def test_an_hf_model_uses_its_own_switch_non_reentrant(tmp_path):
    trainer = make_trainer(make_args(tmp_path, max_steps=1, gradient_checkpointing=True))
    trainer.train()
    layer = trainer.model.model.layers[0]
    assert layer.gradient_checkpointing is True
    assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    assert "forward" not in vars(layer)  # forge wrapped nothing itself


def test_hf_every_n_layers_and_named_blocks(tmp_path):
    every = make_trainer(make_args(tmp_path, max_steps=1, activation_checkpointing_every=2))
    every.train()
    assert [layer.gradient_checkpointing for layer in every.model.model.layers] == [True, False]

    names = list(LlamaForCausalLM(tiny_llama_config()).state_dict())
    named = make_trainer(
        make_args(tmp_path, max_steps=1, activation_checkpointing_modules=["model.layers.1"])
    )
    named.train()  # forge's own wrapping: HF's switch stays off
    layers = named.model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [False, False]
    assert ["forward" in vars(layer) for layer in layers] == [False, True]
    assert list(named.model.state_dict()) == names


# ------------------------------------------------------------------ the order of the stage


def test_the_stage_runs_in_order_and_a_trainer_overrides_only_the_parallel_wrap(tmp_path):
    seen: list[str] = []

    class Recording(Trainer):
        def build_model(self):
            seen.append("build")
            return super().build_model()

        def apply_adapters(self, model):
            seen.append("adapters")
            return super().apply_adapters(model)

        def compile_model(self, model):
            checkpointed = "forward" in vars(model.blocks[0])
            seen.append(f"compile (blocks checkpointed: {checkpointed})")
            return model  # stands in for torch.compile

        def parallelize(self, model):
            seen.append("parallelize")
            return super().parallelize(model)

    args = make_args(tmp_path, max_steps=1, torch_compile=True, gradient_checkpointing=True)
    trainer = Recording(TinyLM, args, TokenDataset(8), data_collator=CausalLMCollator(0))
    trainer.train()
    assert seen == ["build", "adapters", "compile (blocks checkpointed: True)", "parallelize"]


@pytest.mark.slow
def test_compiled_and_checkpointed_trains_like_neither(tmp_path, monkeypatch):
    compile_eager = functools.partial(torch.compile, backend="eager")  # no C++ toolchain
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_eager(model))
    plain = tiny_lm_trainer(tmp_path / "plain")
    plain.train()
    both = tiny_lm_trainer(tmp_path / "both", torch_compile=True, gradient_checkpointing=True)
    both.train()
    assert isinstance(both.evaluation_model(), torch._dynamo.eval_frame.OptimizedModule)
    assert logged_losses(tmp_path / "both") == pytest.approx(logged_losses(tmp_path / "plain"))
