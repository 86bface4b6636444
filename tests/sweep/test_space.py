"""A sweep's axes as written on the command line or in a sweep file, and its plan."""

from __future__ import annotations

import pytest

from forge.sweep.space import SweepSpec, SweepUsageError, direction_for, parse_axis


def test_lists_and_distributions_parse():
    assert parse_axis("lr", "1e-4,3e-4").values == (1e-4, 3e-4)
    assert parse_axis("lr", "loguniform(1e-4, 1e-2)").describe() == "loguniform(0.0001,0.01)"
    width = parse_axis("hidden_size", "int(32,256,log)")
    assert (width.low, width.high, width.log) == (32, 256, True)
    assert parse_axis("opt", "choice(adamw,sgd)").values == ("adamw", "sgd")
    assert parse_axis("hidden_size", [32, 64]).values == (32, 64)
    assert parse_axis("lr", {"loguniform": [1e-4, 1e-2]}).kind == "loguniform"
    assert parse_axis("max_steps", "100") is None  # a fixed value


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("loguniform(1e-2,1e-4)", "LOW must be below HIGH"),
        ("loguniform(0,1)", "a log scale needs LOW > 0"),
        ("int(1.5,3)", "whole numbers"),
        ("uniform(a,b)", "must be numbers"),
        ("uniform(1)", "two bounds"),
        ("gauss(0,1)", "unknown distribution 'gauss'"),
        ("1e-3,,1e-2", "an empty value"),
        ("1,2,1", "listed twice"),
    ],
)
def test_malformed_axes_are_refused(raw, says):
    with pytest.raises(SweepUsageError, match=says):
        parse_axis("learning_rate", raw)


def test_grid_order_and_random_draws_depend_only_on_seed_and_number():
    axes = [parse_axis("a", "1,2"), parse_axis("b", "x,y,z")]
    grid = SweepSpec("train.yaml", axes).grid()
    assert grid[:2] == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}] and len(grid) == 6
    ranged = [parse_axis("lr", "loguniform(1e-4,1e-2)"), parse_axis("h", "int(8,16)")]
    spec = SweepSpec("train.yaml", ranged, method="random", seed=3)
    draws = [spec.trial_values(n) for n in range(20)]
    assert draws == [spec.trial_values(n) for n in range(20)]
    assert all(1e-4 <= d["lr"] <= 1e-2 and 8 <= d["h"] <= 16 for d in draws)
    assert SweepSpec("train.yaml", ranged, method="random", seed=4).trial_values(0) != draws[0]


def test_a_grid_takes_lists_and_a_direction_is_asked_for_unless_a_loss():
    with pytest.raises(SweepUsageError, match="a grid takes lists"):
        SweepSpec("t.yaml", [parse_axis("lr", "uniform(0,1)")]).check()
    assert direction_for("eval_loss", None) == "minimize"
    assert direction_for("eval_accuracy", "max") == "maximize"
    with pytest.raises(SweepUsageError, match="--direction"):
        direction_for("eval_accuracy", None)
