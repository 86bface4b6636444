"""docs/trainers.md's table of features by strategy stays true: every test a cell names exists
(found by reading the test files, not by running them), and every refusal a cell claims is the
one forge's checks produce for that combination, starting with the argument the cell names.
Cheap: no process group, no training."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from forge.train import TrainingArgumentsError
from forge.train.args import TrainingArguments
from forge.train.args.accelerate import AccelTrainingArguments
from forge.train.args.pipeline import PipelineTrainingArguments
from forge.train.batch_finder import auto_batch_problems
from forge.train.checks import check_trainer_arguments
from forge.train.strategies.pipeline import UNSUPPORTED
from forge.train.topology import Topology
from forge.train.trainers import PipelineTrainer
from tests.docs import find
from tests.helpers import REPO

STRATEGIES = ["One process", "DDP", "FSDP", "HSDP", "Accelerate", "Pipeline", "Pipeline × FSDP"]
FEATURES = [
    "EMA",
    "LoRA",
    "Activation checkpointing",
    "Compile",
    "Auto batch size",
    "Length grouping",
    "Token budgets",
    "Packing",
    "Streams",
]
#: the arguments that turn each feature on, as far as TrainingArguments holds them
SETTINGS: dict[str, dict] = {
    "EMA": {"ema_decay": 0.9},
    "LoRA": {},  # a trainer argument (peft_config)
    "Activation checkpointing": {"activation_checkpointing": True},
    "Compile": {"torch_compile": True},
    "Auto batch size": {"auto_find_batch_size": True},
    "Length grouping": {"train_sampling_strategy": "group_by_length"},
    "Token budgets": {"train_sampling_strategy": "group_by_length", "max_tokens_per_batch": 64},
    "Packing": {},  # a collator that packs
    "Streams": {},  # an iterable training dataset
}


def table() -> dict[tuple[str, str], str]:
    """The cells of the table, by (feature, strategy)."""
    head = r"\| Feature \| One process \|[^\n]*\n\|[-|]+\|\n((?:\|[^\n]*\n)+)"
    rows = find(head, "the table of features by strategy").group(1).splitlines()
    cells = {}
    for row in rows:
        feature, *values = (cell.strip() for cell in row.strip().strip("|").split("|"))
        assert len(values) == len(STRATEGIES), f"row {feature!r} has {len(values)} cells"
        cells.update(
            {(feature, strategy): v for strategy, v in zip(STRATEGIES, values, strict=True)}
        )
    assert [f for f, s in cells if s == STRATEGIES[0]] == FEATURES
    return cells


def parametrize_ids(decorator: ast.expr) -> set[str] | None:
    """The ids a ``pytest.mark.parametrize`` decorator gives (None: not one)."""
    if not (
        isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("parametrize")
    ):
        return None
    ids = next((k.value for k in decorator.keywords if k.arg == "ids"), None)
    if ids is not None:
        return {ast.literal_eval(element) for element in ids.elts}
    found = set()
    for value in decorator.args[1].elts:
        if isinstance(value, ast.Call):  # pytest.param(value, marks=...)
            value = value.args[0]
        found.add(str(ast.literal_eval(value)))
    return found


def node_ids(path: Path, name: str) -> set[str]:
    """The ids pytest gives the test function ``name`` of ``path``: ``name``, or
    ``name[param]`` for each parameter of a parametrized one (empty: no such function)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            params = [ids for d in node.decorator_list if (ids := parametrize_ids(d)) is not None]
            return {f"{name}[{i}]" for ids in params for i in ids} if params else {name}
    return set()


ARGUMENTS: dict[str, tuple[type, dict]] = {
    "One process": (TrainingArguments, {}),
    "DDP": (TrainingArguments, {}),
    "FSDP": (TrainingArguments, {"fsdp": "full_shard"}),
    "HSDP": (TrainingArguments, {"fsdp": "hybrid_shard"}),
    "Accelerate": (AccelTrainingArguments, {}),
    "Pipeline": (PipelineTrainingArguments, {}),
    "Pipeline × FSDP": (PipelineTrainingArguments, {"fsdp": "full_shard"}),
}


def args_error(cls: type = TrainingArguments, **values) -> str:
    with pytest.raises(TrainingArgumentsError) as err:
        cls(output_dir="unused", report_to="none", **values)
    return str(err.value)


def several_processes(fsdp: str | None, world_size: int) -> Callable[[dict], str]:
    def refusal(settings: dict) -> str:
        args = TrainingArguments(output_dir="unused", report_to="none", fsdp=fsdp, **settings)
        (problem,) = auto_batch_problems(args, Topology(world_size=world_size))
        return problem

    return refusal


def lora_refusal(cls: type, unsupported: dict, values: dict, settings: dict) -> str:
    args = cls(output_dir="unused", report_to="none", **values, **settings)
    with pytest.raises(TrainingArgumentsError) as err:
        check_trainer_arguments(nn.Linear(1, 1), args, unsupported, peft_config=object())
    return str(err.value)


def pipeline_packing(values: dict, settings: dict) -> str:
    trainer = SimpleNamespace(
        data_collator=SimpleNamespace(padding_free=True),
        wrapped_model=nn.Linear(1, 1),
        args=PipelineTrainingArguments(output_dir="unused", report_to="none", **values, **settings),
        refuses_packed_batches=PipelineTrainer.refuses_packed_batches,
    )
    with pytest.raises(ValueError) as err:
        PipelineTrainer._check_packing(trainer)
    return str(err.value)


def refusal_for(feature: str, strategy: str) -> Callable[[dict], str]:
    """How forge is asked for the combination: its check, given the feature's settings."""
    if strategy in ("Pipeline", "Pipeline × FSDP"):
        values = ARGUMENTS[strategy][1]
        if feature == "LoRA":
            return functools.partial(lora_refusal, PipelineTrainingArguments, UNSUPPORTED, values)
        if feature == "Packing":
            return functools.partial(pipeline_packing, values)
        return lambda s: args_error(PipelineTrainingArguments, **values, **s)
    if feature == "LoRA" and strategy in ("FSDP", "HSDP"):
        return functools.partial(lora_refusal, TrainingArguments, {}, ARGUMENTS[strategy][1])
    if feature == "Auto batch size":
        fsdp, world = {"DDP": (None, 2), "FSDP": ("full_shard", 2), "HSDP": ("hybrid_shard", 4)}[
            strategy
        ]
        return several_processes(fsdp, world)
    raise AssertionError(
        f"the table says {feature} under {strategy} is refused; nothing refuses it"
    )


CELLS = table()


@pytest.mark.parametrize("cell", sorted(CELLS), ids=" / ".join)
def test_each_cell_is_a_test_that_exists_or_a_refusal_forge_gives(cell):
    feature, strategy = cell
    text = CELLS[cell]
    named = re.fullmatch(r"`(tests/[\w/]+\.py)::(\w+(?:\[[\w-]+\])?)`", text)
    if named:
        path, test = named.groups()
        assert (REPO / path).is_file(), f"{feature} / {strategy}: {path} does not exist"
        assert test in node_ids(REPO / path, test.split("[")[0]), (
            f"{feature} / {strategy}: {path} has no {test}"
        )
        return
    refused = re.fullmatch(r"refused \(`(\w+)`\): .+", text)
    assert refused, f"{feature} / {strategy}: {text!r} is neither a test nor a refusal"
    message = refusal_for(feature, strategy)(SETTINGS[feature])
    assert re.search(rf"\btrainer(\.args)?\.{refused.group(1)}\b", message), message


@pytest.mark.parametrize(
    "cell", sorted(c for c, text in CELLS.items() if text.startswith("`")), ids=" / ".join
)
def test_the_arguments_of_a_tested_cell_are_accepted(cell):
    """Where the table names a test, the strategy's arguments take the feature's settings: a
    refusal that begins there makes the cell wrong."""
    feature, strategy = cell
    cls, values = ARGUMENTS[strategy]
    cls(output_dir="unused", report_to="none", **values, **SETTINGS[feature])
