"""A sweep's search space: the axes over a config's template variables, and its plan.

An axis is written as a ``-D`` value or a sweep file entry:

    -D learning_rate=1e-4,3e-4,1e-3          a list: a grid axis (and a categorical one)
    -D learning_rate=loguniform(1e-4,1e-2)   log-uniform between the bounds
    -D dropout=uniform(0,0.3)                uniform between the bounds
    -D hidden_size=int(32,256)               an integer between the bounds (both included)
    -D hidden_size=int(32,256,log)           the same, drawn on a log scale
    -D optimizer=choice(adamw,sgd)           categorical
    -D max_steps=100                         a fixed value, the same for every trial

Lists make a grid (every combination). Random search draws each trial's values from a
generator seeded by the sweep's seed and the trial number, so a trial's values never depend on
which worker draws them or when. Nothing here imports torch or Optuna.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

from forge.config.yaml_io import parse_value
from forge.runs import jsonable

KINDS = ("list", "loguniform", "uniform", "int", "choice")
_CALL_RE = re.compile(r"^\s*([A-Za-z_]+)\s*\((.*)\)\s*$", re.S)
_METHODS_OF_OUR_OWN = ("grid", "random")


class SweepUsageError(Exception):
    """A sweep's axes, objective or options are wrong; nothing has run (exit 2)."""


@dataclass(frozen=True)
class Axis:
    """One variable a sweep varies: ``kind`` with its ``values`` (list, choice) or ``low``,
    ``high`` (and ``log`` for int)."""

    name: str
    kind: str
    values: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    log: bool = False

    @property
    def is_list(self) -> bool:
        return self.kind in ("list", "choice")

    def describe(self) -> str:
        if self.kind == "list":
            return ",".join(_text(v) for v in self.values)
        if self.kind == "choice":
            return "choice(" + ",".join(_text(v) for v in self.values) + ")"
        log = ",log" if self.kind == "int" and self.log else ""
        return f"{self.kind}({_text(self.low)},{_text(self.high)}{log})"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "spec": self.describe()}

    def sample(self, rng: random.Random) -> Any:
        """One value drawn with ``rng`` (random search)."""
        if self.is_list:
            return self.values[rng.randrange(len(self.values))]
        low, high = self.low, self.high
        assert low is not None and high is not None
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(low), math.log(high)))
        if self.kind == "uniform":
            return rng.uniform(low, high)
        if self.log:
            value = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
            return min(int(value), int(high))
        return rng.randint(int(low), int(high))


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) and "," in value else str(value)


def parse_axis(name: str, raw: Any) -> Axis | None:
    """The axis that a ``-D name=raw`` (or a sweep file entry) describes, or None for a fixed
    value. SweepUsageError says what is malformed."""
    if isinstance(raw, list):
        return _list_axis(name, "list", raw)
    if isinstance(raw, dict):
        return _mapping_axis(name, raw)
    if not isinstance(raw, str):
        return None
    call = _CALL_RE.match(raw)
    if call:
        kind, inner = call.group(1).lower(), call.group(2)
        parts = [p.strip() for p in inner.split(",")] if inner.strip() else []
        if kind in ("loguniform", "uniform", "int"):
            return _range_axis(name, kind, parts, raw)
        if kind in ("choice", "categorical"):
            return _list_axis(name, "choice", [parse_value(p) for p in parts])
        raise SweepUsageError(
            f"-D {name}={raw}: unknown distribution {kind!r}; use loguniform(LOW,HIGH), "
            "uniform(LOW,HIGH), int(LOW,HIGH[,log]), choice(A,B,...) or a list A,B,C"
        )
    if "," in raw and not raw.strip().startswith(("[", "{", '"', "'")):
        parts = [p.strip() for p in raw.split(",")]
        if any(not p for p in parts):
            raise SweepUsageError(
                f"-D {name}={raw}: an empty value in the list; write the values separated by "
                "commas, e.g. -D learning_rate=1e-4,3e-4,1e-3"
            )
        return _list_axis(name, "list", [parse_value(p) for p in parts])
    return None


def _mapping_axis(name: str, raw: dict[str, Any]) -> Axis:
    """A sweep file's ``{loguniform: [1e-4, 1e-2]}``, ``{int: [32, 256], log: true}``, or
    ``{choice: [a, b]}``."""
    kinds = [k for k in raw if k in ("loguniform", "uniform", "int", "choice", "values")]
    if len(kinds) != 1 or set(raw) - {kinds[0], "log"}:
        raise SweepUsageError(
            f"axis {name}: {raw!r} is not an axis; write one of loguniform: [LOW, HIGH], "
            "uniform: [LOW, HIGH], int: [LOW, HIGH] (log: true), choice: [A, B], or a list"
        )
    kind, value = kinds[0], raw[kinds[0]]
    if kind in ("choice", "values"):
        return _list_axis(name, "choice" if kind == "choice" else "list", list(value or []))
    parts = [str(v) for v in (value if isinstance(value, list) else [value])]
    if raw.get("log"):
        parts.append("log")
    return _range_axis(name, kind, parts, f"{kind}: {value}")


def _list_axis(name: str, kind: str, values: list[Any]) -> Axis:
    if len(values) < 1:
        raise SweepUsageError(f"axis {name}: an empty list of values; give at least one")
    if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
        raise SweepUsageError(f"axis {name}: a value is listed twice in {values}")
    return Axis(name, kind, tuple(values))


def _range_axis(name: str, kind: str, parts: list[str], raw: str) -> Axis:
    log = kind == "int" and len(parts) == 3 and parts[2].lower() == "log"
    bounds = parts[:2] if log else parts
    usage = f"{kind}(LOW,HIGH)" + (" or int(LOW,HIGH,log)" if kind == "int" else "")
    if len(bounds) != 2:
        raise SweepUsageError(f"-D {name}={raw}: {kind} takes two bounds, as {usage}")
    try:
        low, high = (float(b) for b in bounds)
    except ValueError:
        raise SweepUsageError(
            f"-D {name}={raw}: the bounds must be numbers (got {', '.join(bounds)})"
        ) from None
    if kind == "int" and (low != int(low) or high != int(high)):
        raise SweepUsageError(f"-D {name}={raw}: int's bounds must be whole numbers")
    if not low < high:
        raise SweepUsageError(f"-D {name}={raw}: LOW must be below HIGH (got {low} and {high})")
    if (kind == "loguniform" or log) and low <= 0:
        raise SweepUsageError(f"-D {name}={raw}: a log scale needs LOW > 0 (got {bounds[0]})")
    if kind == "int":
        return Axis(name, kind, low=int(low), high=int(high), log=log)
    return Axis(name, kind, low=low, high=high)


@dataclass
class SweepSpec:
    """What a sweep searches and how: everything that names the study (its hash)."""

    config: str
    axes: list[Axis]
    fixed: dict[str, Any] = field(default_factory=dict)
    method: str = "grid"
    objective: str = "eval_loss"
    direction: str = "minimize"
    seed: int = 0
    pruner: str = "none"

    def identity(self) -> dict[str, Any]:
        """What must match for a second ``forge sweep`` to continue this one."""
        return {
            "config": self.config,
            "axes": {a.name: a.describe() for a in self.axes},
            "fixed": {k: jsonable(v) for k, v in sorted(self.fixed.items())},
            "method": self.method,
            "objective": self.objective,
            "direction": self.direction,
            "seed": self.seed,
            "pruner": self.pruner,
        }

    def digest(self) -> str:
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    @property
    def uses_optuna(self) -> bool:
        return self.method not in _METHODS_OF_OUR_OWN

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the list axes, the first axis slowest."""
        names = [a.name for a in self.axes]
        return [
            dict(zip(names, combo, strict=False))
            for combo in itertools.product(*(a.values for a in self.axes))
        ]

    def trial_values(self, number: int) -> dict[str, Any]:
        """Grid point ``number``, or random trial ``number``'s draw (grid and random only)."""
        if self.method == "grid":
            return self.grid()[number]
        rng = random.Random(f"{self.seed}:{number}")
        return {axis.name: axis.sample(rng) for axis in self.axes}

    def check(self) -> None:
        if not self.axes:
            raise SweepUsageError(
                "nothing to sweep: give an axis such as -D learning_rate=1e-4,3e-4,1e-3 or "
                "-D learning_rate=loguniform(1e-4,1e-2) (`forge vars CONFIG` lists the variables)"
            )
        if self.method == "grid":
            ranged = [a.name for a in self.axes if not a.is_list]
            if ranged:
                raise SweepUsageError(
                    f"a grid takes lists of values; {', '.join(ranged)} is a distribution. "
                    "Give a list (-D NAME=A,B,C), or --method random or tpe"
                )


def direction_for(objective: str, direction: str | None) -> str:
    """``minimize`` or ``maximize``: as given, or minimize for a loss-like metric; else a
    SweepUsageError (the direction of an accuracy is not for forge to guess)."""
    if direction is not None:
        wanted = {"min": "minimize", "minimize": "minimize", "max": "maximize"}
        wanted["maximize"] = "maximize"
        if direction.lower() not in wanted:
            raise SweepUsageError(f"--direction must be minimize or maximize (got {direction!r})")
        return wanted[direction.lower()]
    if re.search(r"(loss|perplexity|error|runtime)$", objective):
        return "minimize"
    raise SweepUsageError(
        f"--objective {objective}: say whether to minimize or maximize it with --direction "
        "(only a loss, perplexity or error is taken as minimize)"
    )
