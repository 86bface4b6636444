"""The loop's tallies: steps add on the device, numbers are read once per settle."""

from __future__ import annotations

import math

import torch

from forge.train.loop_state import StepResult, Tally, count_tokens


def step(loss: float, tokens: int = 10, norm: float = 1.0, finite: bool | None = None):
    loss_t = torch.tensor(loss, dtype=torch.float64)
    finite = math.isfinite(loss) and math.isfinite(norm) if finite is None else finite
    return StepResult(loss_t, torch.tensor(float(tokens)), torch.tensor(norm), torch.tensor(finite))


def test_settle_sums_finite_losses_and_counts_skips_and_tokens():
    tally = Tally()
    for s in (step(2.0, 10), step(float("nan"), 20, norm=float("inf")), step(4.0, 30, norm=0.5)):
        tally.add(s)
    assert (tally.loss_sum, tally.finite_steps, tally.tokens) == (0.0, 0, 0)  # not read yet
    settled = tally.settle()
    assert (settled.tokens, settled.skipped) == (60, 1)
    assert tally.steps == 3 and tally.finite_steps == 2 and tally.skipped == 1
    assert tally.loss_sum == 6.0 and tally.mean_loss == 3.0  # the nan step is left out
    assert tally.grad_norm == 0.5  # the last step's
    assert tally.settle() == (0, 0)  # nothing new: nothing added twice
    assert tally.loss_sum == 6.0


def test_skips_and_tokens_add_up_over_settles():
    tally = Tally()
    for _ in range(2):
        tally.add(step(float("inf"), 5))
        tally.add(step(1.0, 5))
        assert tally.settle() == (10, 1)
    assert (tally.skipped, tally.finite_steps, tally.tokens, tally.loss_sum) == (2, 2, 20, 2.0)


def test_a_finite_loss_on_a_skipped_step_is_left_out():
    tally = Tally()
    tally.add(step(5.0, finite=False))  # e.g. finite loss, non-finite gradients
    tally.add(step(1.0))
    tally.settle()
    assert (tally.loss_sum, tally.finite_steps, tally.skipped) == (1.0, 1, 1)


def test_settles_accumulate_and_state_round_trips():
    tally = Tally()
    tally.add(step(1.0, 4))
    tally.settle()
    tally.add(step(3.0, 6, norm=2.0))
    tally.settle()
    assert (tally.loss_sum, tally.tokens, tally.steps) == (4.0, 10, 2)
    saved = tally.state_dict()
    assert saved == {
        "steps": 2,
        "finite_steps": 2,
        "skipped": 0,
        "loss_sum": 4.0,
        "grad_norm": 2.0,
    }
    other = Tally()
    other.add(step(100.0))  # pending work of a tally that is then restored is dropped
    other.load_state_dict(saved)
    assert other.settle() == (0, 0)
    assert other.mean_loss == 2.0 and other.grad_norm == 2.0


def test_an_empty_tally_has_no_mean():
    tally = Tally()
    assert math.isnan(tally.mean_loss) and math.isnan(tally.grad_norm)
    assert tally.settle() == (0, 0)


def test_tokens_are_the_mask_ones_else_the_ids():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    counted = count_tokens({"input_ids": torch.zeros(2, 3), "attention_mask": mask})
    assert isinstance(counted, torch.Tensor) and int(counted) == 3
    assert count_tokens({"input_ids": torch.zeros(2, 3, dtype=torch.long)}) == 6
    assert count_tokens({"pixels": torch.zeros(2)}) == 0
