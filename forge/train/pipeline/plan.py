"""The plan of a pipeline job: which parts of the model each stage holds, on which process,
and how each batch is cut into microbatches, worked out on the model's meta-device skeleton.

The same plan is made by ``forge train`` (and ``--dry-run``, which prints it) before any
process starts, with the job's process count, and by every worker when its trainer is built,
so a split that cannot run is reported once, located, before torchrun starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from forge.train.args import TrainingArgumentsError
from forge.train.pipeline.presets import model_parts
from forge.train.pipeline.split import PipelineLayout, SplitError, split_layers
from forge.train.pipeline.stage_init import tie_groups, warn_whole_build, with_tie_owners

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelinePlan:
    """Every stage of the job, who writes which weight, and the microbatches of a batch."""

    layout: PipelineLayout
    writer: dict[str, int]  # state-dict key -> the process (stage rank) that writes it
    shared: dict[str, list[int]]  # a parameter several processes hold (a tied embedding)
    num_microbatches: int
    dp_size: int
    schedule: str

    @property
    def num_processes(self) -> int:
        """Processes per pipeline replica."""
        return self.layout.num_ranks

    def held_modules(self, model: nn.Module) -> list[set[str]]:
        """The modules each process of a replica holds (with the first holder of a tensor tied
        to one of them), of ``model`` (a meta skeleton will do)."""
        ties = tie_groups(model)
        return [
            with_tie_owners(self.layout.rank_modules(r), ties) for r in range(self.num_processes)
        ]

    def describe(self) -> list[str]:
        """The plan in lines: one for the job, one per stage."""
        parts = self.layout.parts
        lines = [
            f"pipeline: {len(self.layout.stages)} stage(s) on {self.num_processes} process(es) "
            f"per replica x {self.dp_size} replica(s); schedule {self.schedule}, "
            f"{self.num_microbatches} microbatch(es) per batch"
        ]
        for spec in self.layout.stages:
            first, last = spec.layers.start, spec.layers.stop - 1
            layers = f"{parts.layers}.{first}" + (f"-{last}" if last > first else "")
            held = [*(parts.embedding if spec.first else ()), layers]
            held += list(parts.head) if spec.last else []
            lines.append(
                f"  stage {spec.index} (process {spec.index % self.num_processes}): "
                + " + ".join(held)
            )
        if self.shared:
            tied = ", ".join(
                f"{n} (processes {', '.join(map(str, r))})" for n, r in self.shared.items()
            )
            lines.append(f"  shared across stages, gradients summed: {tied}")
        return lines


def pipeline_size(args: Any, world_size: int) -> tuple[int, list[str]]:
    """Processes per pipeline (``pipeline_parallel_size``, or all of them), and the problem
    when that does not divide the job."""
    size = args.pipeline_parallel_size or world_size
    if world_size % size:
        sharded = args.fsdp not in (None, "", False, [])
        return size, [
            f"{args.config_key}.pipeline_parallel_size {size} does not divide the "
            f"{world_size} processes; start a multiple of {size} processes (each group of "
            "that many is one pipeline"
            + (", and fsdp shards each stage over the groups: stages x shards)" if sharded else ")")
        ]
    return size, []


def plan_pipeline(model: nn.Module, args: Any, world_size: int) -> PipelinePlan:
    """The plan for ``model`` (a meta skeleton will do) split as ``args`` (the pipeline
    trainer's arguments) say over ``world_size`` processes; raises TrainingArgumentsError
    listing every problem."""
    key = args.config_key
    size, problems = pipeline_size(args, world_size)
    named = {name: getattr(args, name) for name in _PART_KEYS}
    parts, part_problems = model_parts(model, named, key)
    problems += part_problems
    microbatches = args.pipeline_microbatches or size
    problems += _microbatch_problems(args, microbatches, size)
    specs = []
    if not part_problems:
        num_stages = size * args.pipeline_stages_per_rank
        try:
            specs = split_layers(
                parts.num_layers(model), num_stages, args.pipeline_split, parts, key
            )
        except SplitError as exc:
            problems += exc.problems
    if problems:
        raise TrainingArgumentsError(problems)
    layout = PipelineLayout(parts, tuple(specs), size)
    writer, shared = layout.holders(model)
    return PipelinePlan(
        layout, writer, shared, microbatches, world_size // size, args.pipeline_schedule
    )


_PART_KEYS = ("pipeline_embedding", "pipeline_layers", "pipeline_head", "pipeline_rotary")


def _microbatch_problems(args: Any, n: int, stages: int) -> list[str]:
    """Whether each batch splits into ``n`` microbatches the schedule can run on ``stages``
    processes."""
    key, problems = args.config_key, []
    batch = args.per_device_train_batch_size
    if batch % n:
        problems.append(
            f"{key}.per_device_train_batch_size {batch} is not a multiple of the {n} "
            f"microbatches each batch is split into (pipeline_microbatches: null means one "
            f"per pipeline stage); use a multiple of {n} or set pipeline_microbatches"
        )
    if args.pipeline_schedule == "1f1b" and n < stages:
        problems.append(
            f"{key}.pipeline_microbatches {n} is fewer than the {stages} pipeline stages, "
            "which 1f1b needs at least; raise it or use gpipe"
        )
    if args.pipeline_schedule == "interleaved_1f1b":
        rounds = max(1, n // stages)
        if n % rounds:
            problems.append(
                f"{key}.pipeline_microbatches {n}: interleaved_1f1b needs a multiple of "
                f"{rounds} (microbatches // stages) or fewer than {2 * stages}"
            )
    return problems


def meta_skeleton(
    model_init: Callable[[], Any], *, build_if_needed: bool = True
) -> nn.Module | None:
    """The model's structure without its weights, built on the meta device. A builder that
    cannot run there (one that reads weights from disk) builds the model itself, or, with
    ``build_if_needed`` false, gives None (the workers plan on the real model then)."""
    try:
        with torch.device("meta"):
            skeleton = model_init()
    except Exception as exc:  # any failure: plan on the real model instead
        if not build_if_needed:
            logger.debug("the model cannot be built on the meta device (%s)", exc)
            return None
        warn_whole_build(
            "planning the pipeline split on the whole model",
            f"it cannot be built on the meta device ({exc})",
        )
        skeleton = model_init()
    if not isinstance(skeleton, nn.Module):
        raise TypeError(
            f"trainer.model built a {type(skeleton).__name__}, not an nn.Module; pass a "
            "module or a callable (e.g. !partial) that returns one"
        )
    return skeleton
