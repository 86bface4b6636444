"""The adaptive-computation model under activation checkpointing: a block called a varying
number of times on varying batch sizes (samples halt at different passes), dropout on, gives
the gradients of the plain model bit for bit, through forge's transform stage."""

from __future__ import annotations

import copy

import pytest
import torch

from forge.models import AdaptiveComputationModel
from forge.train import TrainingArguments
from forge.train.transforms import apply_activation_checkpointing
from tests.train.common import assert_same_tensors

BATCH, LENGTH, DIGITS = 16, 8, 10


def make_model(**overrides) -> AdaptiveComputationModel:
    values = dict(hidden_size=32, num_heads=4, ffn_size=64, num_blocks=3, max_steps=6)
    values.update(dropout=0.3, halt_bias=-1.0)
    values.update(overrides)
    torch.manual_seed(0)
    model = AdaptiveComputationModel(DIGITS, DIGITS, LENGTH, **values)
    with torch.no_grad():  # halting probabilities spread out: samples halt at different passes
        model.halt.weight.mul_(40)
    return model


def batch() -> dict[str, torch.Tensor]:
    digits = torch.randint(DIGITS, (BATCH, LENGTH), generator=torch.Generator().manual_seed(3))
    return {"input_ids": digits, "labels": digits.sort().values}


class PassSizes:
    """The batch size of every call of each block's MLP: in the forward pass, and in the
    backward pass (a checkpointed block runs its forward again there)."""

    def __init__(self, model: AdaptiveComputationModel) -> None:
        self.calls: dict[int, list[int]] = {i: [] for i in range(len(model.blocks))}
        for index, block in enumerate(model.blocks):
            block.mlp.register_forward_pre_hook(self._hook(index))

    def _hook(self, index):
        def record(module, inputs):
            self.calls[index].append(inputs[0].shape[0])

        return record

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()


def gradients(model, sizes: PassSizes | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model.train()
    outputs = model(**batch())
    forward_calls = {i: list(c) for i, c in sizes.calls.items()} if sizes else None
    outputs["loss"].backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return outputs, grads, forward_calls


def checkpointed(model, **values):
    args = TrainingArguments(output_dir="/tmp/unused", report_to="none", **values)
    return apply_activation_checkpointing(model, args)


def test_the_number_of_passes_varies_per_sample():
    model = make_model()
    sizes = PassSizes(model)
    outputs, _, forward_calls = gradients(model, sizes)
    passes = forward_calls[0]
    assert passes[0] == BATCH and len(set(passes)) > 2, passes  # samples halt at several passes
    assert passes == sorted(passes, reverse=True)
    assert 1 < float(outputs["mean_steps"]) < len(passes)
    assert float(outputs["ponder_cost"]) >= float(outputs["mean_steps"])
    assert outputs["logits"].shape == (BATCH, LENGTH, DIGITS)
    assert outputs["ponder_cost"].dim() == outputs["mean_steps"].dim() == 0


@pytest.mark.parametrize(
    ("values", "recomputed"),
    [
        ({"activation_checkpointing": True}, [True, True, True]),  # the repeated blocks
        ({"activation_checkpointing_modules": ["RecurrentBlock"]}, [True, True, True]),
        (
            {"activation_checkpointing_modules": ["blocks"], "activation_checkpointing_every": 2},
            [True, False, True],
        ),
        ({"activation_checkpointing_modules": ["blocks.1"]}, [False, True, False]),
    ],
    ids=["default", "class", "every-2", "one"],
)
def test_checkpointing_gives_the_same_gradients_with_dropout(values, recomputed):
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    assert checkpointed(wrapped, **values) is not None
    plain_sizes, wrapped_sizes = PassSizes(plain), PassSizes(wrapped)
    plain_out, plain_grads, plain_forward = gradients(plain, plain_sizes)
    out, grads, forward = gradients(wrapped, wrapped_sizes)
    # the same halting decisions: every pass ran on the same samples
    assert forward == plain_forward and len(set(forward[0])) > 2
    assert_same_tensors(out, plain_out, "outputs")
    assert_same_tensors(grads, plain_grads, "grads")
    assert any(g.abs().sum() > 0 for g in grads.values())
    # the wrapped blocks did run again in the backward pass, each pass on its own samples
    for index, again in enumerate(recomputed):
        expected = forward[index] + sorted(forward[index]) if again else forward[index]
        assert wrapped_sizes.calls[index] == expected, index
        assert plain_sizes.calls[index] == forward[index]


def test_another_seed_gives_other_dropout_and_other_gradients():
    """The equality above is not vacuous: the gradients depend on the dropout masks."""
    plain = make_model()
    _, first, _ = gradients(copy.deepcopy(plain), seed=0)
    _, second, _ = gradients(copy.deepcopy(plain), seed=1)
    assert any(not torch.equal(first[name], second[name]) for name in first)


def test_evaluation_takes_no_recomputation_and_is_deterministic():
    model = make_model()
    checkpointed(model, activation_checkpointing=True)
    sizes = PassSizes(model)
    model.eval()
    with torch.no_grad():
        first = model(**batch())
        second = model(**batch())
    assert torch.equal(first["logits"], second["logits"])
    calls = sizes.calls[0]
    assert calls[: len(calls) // 2] == calls[len(calls) // 2 :]  # the same passes, once each


def test_max_steps_caps_the_passes():
    model = make_model(max_steps=2, halt_bias=-20.0)
    with torch.no_grad():
        model.halt.weight.zero_()  # a halting probability of ~0: never halts by itself
    sizes = PassSizes(model)
    outputs, _, forward = gradients(model, sizes)
    assert forward[0] == [BATCH, BATCH]
    assert float(outputs["mean_steps"]) == 2.0
    assert float(outputs["ponder_cost"]) == pytest.approx(3.0, abs=0.01)  # 2 passes + ~1 left


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="max_steps must be at least 1"):
        AdaptiveComputationModel(10, 10, 8, max_steps=0)


def test_without_the_random_state_kept_recomputed_dropout_differs():
    """What keeping the random state buys: recomputed with fresh dropout masks, the gradients
    are no longer the plain model's (so the equality above tests the random state)."""
    plain = make_model()
    wrapped = copy.deepcopy(plain)
    checkpointed(
        wrapped,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"preserve_rng_state": False},
    )
    _, plain_grads, _ = gradients(plain)
    _, grads, _ = gradients(wrapped)
    assert any(not torch.equal(grads[name], plain_grads[name]) for name in grads)
