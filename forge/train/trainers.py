"""The three trainers users and templates name: the shared loop (forge/train/loop.py), each
composed with its parallelism strategy (forge/train/strategies/).

- ``Trainer``: one process, DDP over the ranks torchrun starts, or FSDP2 with ``fsdp`` set;
- ``AccelTrainer``: Hugging Face Accelerate does the device work;
- ``PipelineTrainer``: the model split into pipeline stages, times data-parallel replicas.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from forge.train import lora
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.args.pipeline import PipelineTrainingArguments
from forge.train.loop import BaseTrainer
from forge.train.pipeline.plan import meta_skeleton, pipeline_size, plan_pipeline
from forge.train.sanity import is_stand_in
from forge.train.strategies.accelerate import Accelerate, accelerate_config_problems
from forge.train.strategies.base import ParallelStrategy
from forge.train.strategies.ddp import DataParallel
from forge.train.strategies.fsdp import FullyShard
from forge.train.strategies.pipeline import UNSUPPORTED, Pipeline
from forge.train.topology import Topology
from forge.train.transforms import activation_checkpointing_problems


class Trainer(BaseTrainer):
    """Train a model in one process, or with DDP under ``torchrun`` (``WORLD_SIZE`` > 1).

    Under torchrun the trainer creates the process group if none exists (gloo on CPU, nccl
    on CUDA, or ``args.ddp_backend``) and destroys it at the end, wraps the model in DDP (or
    shards it with FSDP2 when ``args.fsdp`` is set: forge/train/strategies/fsdp.py),
    gives every rank its shard of the data, and lets only rank 0 log, report and write shared
    checkpoint files; every rank writes its own random and data state. See ``BaseTrainer``
    for the arguments.
    """

    trainer_kind: ClassVar[str] = "plain"

    def make_strategy(self, device: torch.device) -> ParallelStrategy:
        args, topology = self.args, self.topology
        settings = args.fsdp_settings()
        if settings is not None and topology.distributed:
            return FullyShard(args, topology, device, settings)
        if settings is not None:
            self._info("fsdp: one process holds the whole model; nothing to shard")
        if topology.distributed:
            return DataParallel(args, topology, device)
        return ParallelStrategy(args, topology, device)


class AccelTrainer(BaseTrainer):
    """Train with Hugging Face Accelerate, in one process or under ``torchrun`` /
    ``accelerate launch`` (the ranks come from the environment either sets).

    ``args`` may be ``AccelTrainingArguments`` (mixed precision, ``split_batches``) or plain
    ``TrainingArguments``. See ``BaseTrainer`` for the other arguments.
    """

    trainer_kind: ClassVar[str] = "accelerate"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        problems = accelerate_config_problems(os.environ)
        if problems:
            raise TrainingArgumentsError(problems)
        super().__init__(*args, **kwargs)

    def make_strategy(self, device: torch.device) -> ParallelStrategy:
        return Accelerate(self.args, self.topology, device)

    @property
    def accelerator(self) -> Any:
        """The ``accelerate.Accelerator`` while ``train()`` / ``evaluate()`` runs, else None."""
        return self.strategy.accelerator


class PipelineTrainer(BaseTrainer):
    """Train a model split into pipeline stages, times data-parallel replicas, under
    ``torchrun`` (``forge train --nproc N``); see forge/train/strategies/pipeline.py.

    ``args`` are ``PipelineTrainingArguments`` (plain ``TrainingArguments`` take their
    defaults). ``loss_fn(logits, labels)`` replaces the causal-LM loss (the model's own
    ``loss_function`` for Hugging Face models). ``model`` should be a builder (a
    ``!partial``): each stage then builds only its own part. See ``BaseTrainer`` for the
    other arguments.
    """

    trainer_kind: ClassVar[str] = "pipeline"
    unsupported_arguments: ClassVar[dict[str, str]] = UNSUPPORTED
    refuses_packed_batches: ClassVar[str] = (
        "the pipeline trainer's stages number the positions themselves and split a batch "
        "into micro-batches by rows, so a packed batch's position_ids never reach the attention"
    )

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        args: TrainingArguments,
        *positional: Any,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(args, TrainingArguments) and not isinstance(args, PipelineTrainingArguments):
            args = PipelineTrainingArguments(**args.to_dict())
        self.loss_fn = loss_fn
        super().__init__(model, args, *positional, **kwargs)

    def make_topology(self) -> Topology:
        """Stage-major ranks: ``pipeline_parallel_size`` stages, the rest replicas."""
        env = Topology.from_env()
        if is_stand_in() and env.world_size == 1:
            # the sanity pass's one process runs the whole model as one stage: the job's
            # split (its size, stage starts, stages per rank) is its plan's to check
            self.args = dataclasses.replace(
                self.args,
                pipeline_parallel_size=None,
                pipeline_split=None,
                pipeline_stages_per_rank=1,
                pipeline_schedule=(
                    "1f1b"
                    if self.args.pipeline_schedule == "interleaved_1f1b"
                    else self.args.pipeline_schedule
                ),
            )
        size, problems = pipeline_size(self.args, env.world_size)
        if problems:
            raise TrainingArgumentsError(problems)
        return env.with_stages(size)

    def make_strategy(self, device: torch.device) -> ParallelStrategy:
        """The split of the whole model (built on the meta device from a builder), planned for
        this job's processes."""
        self._check_loss(self.args)
        given = self.model if self.model is not None else self.model_init
        skeleton = given if isinstance(given, nn.Module) else meta_skeleton(given)
        plan = plan_pipeline(skeleton, self.args, self.topology.world_size)
        problems = activation_checkpointing_problems(skeleton, self.args)  # the whole model's
        if self.peft_config is not None:  # each stage adapts its own layers
            problems += lora.split_problems(skeleton, self.peft_config, plan.held_modules(skeleton))
        if problems:  # (a stage holds only some of the named blocks)
            raise TrainingArgumentsError(problems)
        settings = self.args.fsdp_settings()
        if settings is not None and self.topology.dp_size == 1 and not is_stand_in():
            self._info("fsdp: one process per stage holds the whole stage; nothing to shard")
        strategy = Pipeline(self.args, self.topology, device, plan, self.loss_fn, settings)
        strategy.prune_after_adapter = self.peft_config is not None
        return strategy

    def apply_adapters(self, model: nn.Module) -> nn.Module:
        """A LoRA stage's base must be a model directory on disk, which the run references (a
        stage holds only its part of a base it would have to write whole)."""
        if self.adapter is None:
            return model
        if self._in_train and lora.base_on_disk(model) is None:
            raise lora.LoraUsageError(
                "the pipeline trainer fine-tunes with LoRA a base read from a model directory "
                "(base_model=PATH: a forge checkpoint, export or Hugging Face directory), which "
                "the run references; this model was built in memory, and each stage holds only "
                "its own part of it, so no stage could write the base the adapter needs. Save "
                "the model first (forge export) and give it as base_model, or train with the "
                "plain trainer"
            )
        model = super().apply_adapters(model)
        self.strategy.prune(model)  # built whole (the rest on the meta device) until adapted
        return model

    def _check_loss(self, args: TrainingArguments) -> None:
        """What would change the loss elsewhere and cannot here is refused: the last stage
        computes it from the logits and the labels alone."""
        problems = []
        if type(self).compute_loss is not BaseTrainer.compute_loss:
            problems.append(
                f"{type(self).__name__} overrides compute_loss, which the pipeline trainer never "
                "calls: its last stage computes the loss from the logits and the labels alone, "
                "without the model's other outputs; give the trainer loss_fn(logits, labels) "
                "instead"
            )
        if self.loss_fn is not None and args.label_smoothing_factor:
            problems.append(
                f"{args.config_key}.label_smoothing_factor smooths the trainer's own loss, and "
                "trainer.loss_fn replaces it; smooth the labels inside loss_fn, or set "
                "label_smoothing_factor: 0"
            )
        if problems:
            raise TrainingArgumentsError(problems)

    @classmethod
    def plan_job(
        cls, model: Any, args: TrainingArguments, world_size: int, peft_config: Any = None
    ) -> list[str] | None:
        """The plan of a job of ``world_size`` processes training ``model`` (a module built on
        the meta device, or a builder) with ``args`` (and the LoRA ``peft_config``), as lines
        to print; None when the model cannot be built on the meta device (the workers plan it
        then). Raises TrainingArgumentsError as the trainer would: ``forge train`` calls this
        before it launches the job."""
        if not isinstance(args, PipelineTrainingArguments):
            args = PipelineTrainingArguments(**args.to_dict())
        if not isinstance(model, nn.Module):
            model = meta_skeleton(model, build_if_needed=False)
        if model is None:
            return None
        plan = plan_pipeline(model, args, world_size)
        problems = activation_checkpointing_problems(model, args)
        if peft_config is not None:
            problems += lora.split_problems(model, peft_config, plan.held_modules(model))
        if problems:
            raise TrainingArgumentsError(problems)
        return plan.describe()

    @property
    def plan(self) -> Any:
        return self.strategy.plan

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors this stage writes: those it holds that no earlier stage holds."""
        return self.strategy.stage_state_dict(self.model)
