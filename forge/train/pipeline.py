"""The pipeline-parallel trainer: the model split into stages across processes, each stage
writing only its own shard of the weights and optimizer state.

``pipeline_parallel_size`` processes form one pipeline (one stage each, or several with
``interleaved_1f1b``); the remaining processes are data-parallel replicas of it, so
``--nproc 4`` with 2 stages trains 2 replicas, each on its own shard of the data. Ranks are
stage-major within a replica (``Topology``): rank = replica * stages + stage.

A step runs ``torch.distributed.pipelining``: every loop micro-batch is split into
``pipeline_microbatches`` pieces that flow through the stages on the chosen schedule (GPipe,
1F1B or interleaved 1F1B); the last stage computes the loss. Then gradients are averaged over
the replicas of each stage and summed over the stages sharing a tied weight, and clipped by
the norm over all stages. Everything else (schedule, accumulation, evaluation, early
stopping, signals, callbacks, checkpoints) is the shared loop's.

Every rank loads the same batches as the other stages of its replica: stage 0 reads the
input ids, the last stage the labels.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from forge.checkpoint import Component, ModelWeights, load_model_weights
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.args_values import as_int
from forge.train.base import BaseTrainer
from forge.train.loop_state import Batch, count_tokens
from forge.train.pipeline_plan import meta_skeleton, pipeline_size, plan_pipeline
from forge.train.pipeline_split import StageModule, causal_lm_loss, prune_to_stages
from forge.train.stage_init import build_partial_model, free_except
from forge.train.topology import Topology
from forge.train.transforms import activation_checkpointing_problems

logger = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_BATCH_KEYS = {"input_ids", "labels", "attention_mask"}


@dataclass
class PipelineTrainingArguments(TrainingArguments):
    """TrainingArguments plus how the model is split into pipeline stages.

    ``pipeline_parallel_size``: processes per pipeline (null: all of them); the others are
    data-parallel replicas. ``pipeline_microbatches``: pieces each loop batch is split into
    (null: one per pipeline process); ``per_device_train_batch_size`` must be a multiple.
    ``pipeline_schedule``: ``gpipe``, ``1f1b`` or ``interleaved_1f1b`` (with
    ``pipeline_stages_per_rank`` >= 2). ``pipeline_split``: the layers where the stages after
    the first begin (``[model.layers.2]``); null splits the layers evenly.
    ``pipeline_embedding`` (the modules before the layers, token embedding first),
    ``pipeline_layers``, ``pipeline_head`` (the modules after the layers) and
    ``pipeline_rotary`` name the model's parts; null takes them from the preset of the
    model's family (GPT-2, GPT-Neo, GPT-NeoX, OPT, Llama-like, Phi, BERT/RoBERTa masked LMs:
    forge/train/pipeline_models.py), and a model of no known family must name them.
    """

    pipeline_parallel_size: int | None = None
    pipeline_microbatches: int | None = None
    pipeline_schedule: str = "1f1b"
    pipeline_stages_per_rank: int = 1
    pipeline_split: tuple[str, ...] | None = None
    pipeline_embedding: tuple[str, ...] | None = None
    pipeline_layers: str | None = None
    pipeline_head: tuple[str, ...] | None = None
    pipeline_rotary: str | None = None

    def validate(self) -> list[str]:
        p = super().validate()
        if self.pipeline_parallel_size is not None:
            self._int("pipeline_parallel_size", p, minimum=1, fix="or null for every process")
        if self.pipeline_microbatches is not None:
            self._int("pipeline_microbatches", p, minimum=1, fix="or null for one per stage")
        self._int("pipeline_stages_per_rank", p, minimum=1)
        self._choice("pipeline_schedule", SCHEDULES, p)
        for name in ("pipeline_layers", "pipeline_rotary"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                p.append(f"{self._key(name)} must be a module name or null (got {value!r})")
        self._names("pipeline_embedding", p, allow_none=True)
        self._names("pipeline_head", p, allow_none=True)
        self._names("pipeline_split", p, allow_none=True)
        if self.fsdp not in (None, "", False, []):
            p.append(
                f"{self._key('fsdp')}: the pipeline trainer does not shard its stages: a stage's "
                "parameters are whole on each of its data-parallel replicas (DDP). Shard with the "
                "plain trainer (fsdp: full_shard), or leave fsdp unset"
            )
        self._check_pipeline_fit(p)
        for flag, fix in (("fp16", "use bf16"), ("torch_compile", "set it to false")):
            if getattr(self, flag) is True:
                p.append(f"{self._key(flag)} is not supported by the pipeline trainer; {fix}")
        return p

    def _names(self, name: str, p: list[str], *, allow_none: bool) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, str):
            value = (value,)
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            p.append(
                f"{self._key(name)} must be a list of module names"
                + (" or null" if allow_none else "")
                + f" (got {value!r})"
            )
            return
        setattr(self, name, tuple(value))

    def _check_pipeline_fit(self, p: list[str]) -> None:
        """What can be checked before the job's size is known."""
        schedule, per_rank = self.pipeline_schedule, as_int(self.pipeline_stages_per_rank)
        if schedule == "interleaved_1f1b" and per_rank == 1:
            p.append(
                f"{self._key('pipeline_schedule')} interleaved_1f1b runs several stages per "
                "process; set pipeline_stages_per_rank to 2 or more, or use 1f1b"
            )
        elif schedule in ("gpipe", "1f1b") and per_rank is not None and per_rank > 1:
            p.append(
                f"{self._key('pipeline_stages_per_rank')} is {per_rank}, which only the "
                "interleaved_1f1b schedule runs; set pipeline_schedule: interleaved_1f1b"
            )
        micro = as_int(self.pipeline_microbatches)
        if micro is None or micro < 1:
            return
        batch = as_int(self.per_device_train_batch_size)
        if batch is not None and batch >= 1 and batch % micro:
            p.append(
                f"{self._key('per_device_train_batch_size')} {batch} is not a multiple of "
                f"pipeline_microbatches {micro}; each batch is split into that many equal "
                "microbatches"
            )
        size = as_int(self.pipeline_parallel_size)
        if schedule == "1f1b" and size is not None and micro < size:
            p.append(
                f"{self._key('pipeline_microbatches')} {micro} is fewer than the "
                f"{size} pipeline stages, which 1f1b needs at least; raise it or use gpipe"
            )


class _MicrobatchLoss:
    """The loss the last stage computes per microbatch: records the loss, returns it weighted
    (a microbatch's share of the optimizer step), so gradients accumulate to the mean."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.weight = 1.0
        self.values: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.fn(output, target)
        self.values.append(loss.detach().float())
        return loss * self.weight if self.weight != 1.0 else loss

    def take(self, count: int) -> list[torch.Tensor]:
        """The last ``count`` losses (the schedule's first call may be a shape probe)."""
        values, self.values = self.values[-count:], []
        return values


class PipelineTrainer(BaseTrainer):
    """Train a model split into pipeline stages, times data-parallel replicas, under
    ``torchrun`` (``forge train --nproc N``); see the module docstring.

    ``args`` are ``PipelineTrainingArguments`` (plain ``TrainingArguments`` take their
    defaults). ``loss_fn(logits, labels)`` replaces the causal-LM loss (the model's own
    ``loss_function`` for Hugging Face models). ``model`` should be a builder (a
    ``!partial``): each stage then builds only its own part. See ``BaseTrainer`` for the
    other arguments.
    """

    trainer_kind: ClassVar[str] = "pipeline"
    forward_eval_outputs: ClassVar[bool] = False  # the logits stay on the last stage
    unsupported_arguments: ClassVar[dict[str, str]] = {
        "compute_loss_func": (
            "the pipeline trainer computes the loss on its last stage, which holds the "
            "logits, not the model's outputs; give it loss_fn(logits, labels) instead"
        ),
        "peft_config": (
            "LoRA is not supported by the pipeline trainer: each stage builds only its part of "
            "the model, while a peft model wraps (and its adapter checkpoint names) the whole "
            "model. Fine-tune with the plain or Accelerate trainer (data parallel over the "
            "processes: the frozen base needs no gradients, so it fits where the full model "
            "trained)"
        ),
    }

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
        self._check_loss()
        skeleton = model if isinstance(model, nn.Module) else meta_skeleton(model)
        self.plan = plan_pipeline(skeleton, self.args, self.topology.world_size)
        problems = activation_checkpointing_problems(skeleton, self.args)  # the whole model's
        if problems:  # (a stage holds only some of the named blocks)
            raise TrainingArgumentsError(problems)
        self.layout = self.plan.layout
        self._writer, self._shared = self.plan.writer, self.plan.shared
        self.num_microbatches = self.plan.num_microbatches
        # built by parallelize()
        self.stage_modules: list[StageModule] = []
        self._schedules: dict[tuple, Any] = {}
        self._groups: dict[str, Any] = {}
        self._loss: _MicrobatchLoss | None = None

    # ------------------------------------------------------------------ the split
    def make_topology(self) -> Topology:
        """Stage-major ranks: ``pipeline_parallel_size`` stages, the rest replicas."""
        env = Topology.from_env()
        size, problems = pipeline_size(self.args, env.world_size)
        if problems:
            raise TrainingArgumentsError(problems)
        return env.with_stages(size)

    @property
    def _key(self) -> str:
        return self.args.config_key

    def _check_loss(self) -> None:
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
        if self.loss_fn is not None and self.args.label_smoothing_factor:
            problems.append(
                f"{self._key}.label_smoothing_factor smooths the trainer's own loss, and "
                "trainer.loss_fn replaces it; smooth the labels inside loss_fn, or set "
                "label_smoothing_factor: 0"
            )
        if problems:
            raise TrainingArgumentsError(problems)

    @classmethod
    def plan_job(cls, model: Any, args: TrainingArguments, world_size: int) -> list[str] | None:
        """The plan of a job of ``world_size`` processes training ``model`` (a module built on
        the meta device, or a builder) with ``args``, as lines to print; None when the model
        cannot be built on the meta device (the workers plan it then). Raises
        TrainingArgumentsError as the trainer would: ``forge train`` calls this before it
        launches the job."""
        if not isinstance(args, PipelineTrainingArguments):
            args = PipelineTrainingArguments(**args.to_dict())
        if not isinstance(model, nn.Module):
            model = meta_skeleton(model, build_if_needed=False)
        if model is None:
            return None
        plan = plan_pipeline(model, args, world_size)
        problems = activation_checkpointing_problems(model, args)
        if problems:
            raise TrainingArgumentsError(problems)
        return plan.describe()

    @property
    def my_stages(self):
        return self.layout.rank_stages(self.topology.stage)

    @property
    def holds_first(self) -> bool:
        return any(spec.first for spec in self.my_stages)

    @property
    def holds_last(self) -> bool:
        return any(spec.last for spec in self.my_stages)

    # ------------------------------------------------------------------ setup
    def build_model(self) -> nn.Module:
        """This rank's stages only: from a builder the other parts are never materialised (see
        stage_init); a whole module given to the trainer has their weights freed. Either way
        the parts no stage of this rank holds are removed."""
        if self.model_init is None:
            model = self.model
            free_except(model, self._kept_modules)
        else:
            model = build_partial_model(self.model_init, self._kept_modules)
            if not isinstance(model, nn.Module):
                raise TypeError(
                    f"trainer.model built a {type(model).__name__}, not an nn.Module; pass a "
                    "module or a callable (e.g. !partial) that returns one"
                )
        prune_to_stages(model, self.layout.parts, self.my_stages)
        return model

    @property
    def _kept_modules(self) -> list[str]:
        return self.layout.rank_modules(self.topology.stage)

    def activation_checkpointing_scope(self) -> dict[str, Any]:
        """The stage's layers by default; named blocks other stages hold are theirs (checked
        against the whole model when the trainer was built)."""
        return {"layers": self.layout.parts.layers, "names_checked": True}

    def parallelize(self, model: nn.Module) -> nn.Module:
        """The stage modules, the process groups and the last stage's loss; the model itself
        is what the loop puts in train() / eval() mode."""
        self.stage_modules = [StageModule(model, self.layout.parts, s) for s in self.my_stages]
        self._loss = _MicrobatchLoss(self.loss_fn or self._default_loss(model))
        self._schedules = {}
        self._make_groups()
        self._log_split()
        return model

    def _default_loss(
        self, model: nn.Module
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The model's own loss (``_default_loss``), or with ``label_smoothing_factor`` the
        smoothed cross-entropy the other trainers compute (Hugging Face's ``LabelSmoother``,
        labels shifted for a causal LM)."""
        epsilon = self.args.label_smoothing_factor
        if not epsilon:
            return _default_loss(model)
        from transformers.trainer_pt_utils import LabelSmoother

        smoother, shift = LabelSmoother(epsilon=epsilon), self.layout.parts.causal
        return lambda logits, labels: smoother({"logits": logits}, labels, shift_labels=shift)

    def _make_groups(self) -> None:
        """Every rank creates every group, in one order (``new_group`` is collective)."""
        topo, groups = self.topology, {}
        if not topo.distributed:
            self._groups = groups
            return
        if topo.num_stages > 1:
            groups["pipeline"] = _member_group([topo.replica_ranks(d) for d in range(topo.dp_size)])
        if topo.dp_size > 1:
            groups["replicas"] = _member_group(
                [topo.stage_ranks(s) for s in range(topo.num_stages)]
            )
        for ranks in sorted({tuple(r) for r in self._shared.values()}):
            name = f"shared-{'-'.join(map(str, ranks))}"
            sets = [[d * topo.num_stages + r for r in ranks] for d in range(topo.dp_size)]
            group = _member_group(sets)
            if topo.stage in ranks:
                groups[name] = group
        self._groups = groups

    def _log_split(self) -> None:
        for line in self.plan.describe():
            self._info("%s", line)

    def release_wrappers(self) -> None:
        self._schedules = {}
        self.stage_modules = []
        for group in self._groups.values():
            if dist.is_initialized():
                dist.destroy_process_group(group)
        self._groups = {}
        super().release_wrappers()

    # ------------------------------------------------------------------ one step
    def forward_backward(self, window: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each micro-batch through the pipeline; (mean loss, tokens) on the last stage
        (zero elsewhere, so the loop's sum over ranks counts each replica once)."""
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.long, device=self.device)
        for batch in window:
            inputs, labels, batch = self._inputs(batch)
            losses = self._run(inputs, labels, train=True, weight=1.0 / len(window))
            if self.holds_last:
                loss_sum += torch.stack(losses).mean() / len(window)
                tokens += torch.as_tensor(count_tokens(batch), device=self.device)
        self._sync_gradients()
        return loss_sum, tokens

    def _inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Batch]:
        batch = self._to_device(batch)
        extra = sorted(set(batch) - _BATCH_KEYS)
        if extra or "input_ids" not in batch or "labels" not in batch:
            raise ValueError(
                f"the pipeline trainer feeds a batch's input_ids to the first stage and its "
                f"labels to the loss, and cannot pass on {extra or 'a batch without them'}; "
                "use a collator that gives input_ids and labels (CausalLMCollator)"
            )
        mask = batch.get("attention_mask")
        if mask is not None and not self.layout.parts.causal and not bool(mask.all()):
            raise ValueError(
                "the pipeline trainer's stages of an encoder attend to every position without a "
                "padding mask, and this batch pads; give batches of one length (packed or "
                "truncated), or train the model with the plain trainer"
            )
        if mask is not None and not torch.equal(mask.cummin(dim=-1).values, mask):
            raise ValueError(
                "the pipeline trainer's stages attend causally without a padding mask, which is "
                "exact only for right padding; this batch's attention_mask pads on the left"
            )
        return batch["input_ids"], batch["labels"], batch

    def _run(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, train: bool, weight: float = 1.0
    ) -> list[torch.Tensor]:
        """One batch through this rank's stages; the microbatch losses on the last stage."""
        schedule, count = self._schedule(tuple(inputs.shape), train)
        self._loss.weight = weight / count
        if schedule is None:  # a single stage in one process: no pipeline to run
            return self._run_local(inputs, labels, count, train)
        args = (inputs,) if self.holds_first else ()
        target = labels if self.holds_last else None
        losses = [] if self.holds_last else None
        with self.autocast():
            if train:
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        return self._loss.take(count) if self.holds_last else []

    def _run_local(
        self, inputs: torch.Tensor, labels: torch.Tensor, count: int, train: bool
    ) -> list[torch.Tensor]:
        """All stages in this process: each microbatch forward through them, then backward."""
        for piece, target in zip(inputs.chunk(count), labels.chunk(count), strict=True):
            with self.autocast():
                for module in self.stage_modules:
                    piece = module(piece)
                loss = self._loss(piece, target)
            if train:
                loss.backward()
        return self._loss.take(count)

    def _schedule(self, shape: tuple[int, ...], train: bool) -> tuple[Any, int]:
        """The schedule for batches of ``shape`` (built on first use: a stage's buffers are
        sized by its first microbatch). A short last batch splits into fewer microbatches."""
        count = math.gcd(shape[0], self.num_microbatches)
        key = (train, shape)
        if key not in self._schedules:
            self._schedules[key] = self._make_schedule(count, train)
        return self._schedules[key], count

    def _make_schedule(self, count: int, train: bool) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        if self.topology.num_stages == 1:
            return None
        group = self._groups.get("pipeline")
        stages = [
            PipelineStage(module, spec.index, len(self.layout.stages), self.device, group=group)
            for module, spec in zip(self.stage_modules, self.my_stages, strict=True)
        ]
        if len(stages) > 1:
            return ScheduleInterleaved1F1B(stages, count, loss_fn=self._loss, scale_grads=False)
        fits_1f1b = count >= self.topology.num_stages
        one_f_one_b = train and self.args.pipeline_schedule == "1f1b" and fits_1f1b
        schedule = Schedule1F1B if one_f_one_b else ScheduleGPipe
        return schedule(stages[0], count, loss_fn=self._loss, scale_grads=False)

    def _sync_gradients(self) -> None:
        """Average over the replicas of this stage; sum a tied weight over its stages."""
        replicas = self._groups.get("replicas")
        if replicas is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=replicas)
            flat /= self.topology.dp_size
            for grad, synced in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                grad.copy_(synced)
        params = dict(self.model.named_parameters())
        for name, ranks in self._shared.items():
            group = self._groups.get(f"shared-{'-'.join(map(str, ranks))}")
            grad = params[name].grad if name in params else None
            if group is not None and grad is not None:
                dist.all_reduce(grad, group=group)

    def clip_gradients(self) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (a shared weight counted once)."""
        stage = self.topology.stage
        own = [
            p.grad
            for name, p in self.model.named_parameters()
            if p.grad is not None and self._shared.get(name, [stage])[0] == stage
        ]
        norm = torch.nn.utils.get_total_norm(own) if own else torch.zeros((), device=self.device)
        squares = norm.double().square()
        if "pipeline" in self._groups:
            dist.all_reduce(squares, group=self._groups["pipeline"])
        total = squares.sqrt().to(norm.dtype)
        if self.args.max_grad_norm:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        return total

    # ------------------------------------------------------------------ evaluation
    def forward_eval(
        self, model: nn.Module, batch: Batch, labels: Any
    ) -> tuple[torch.Tensor | None, Any]:
        """The batch through the pipeline, forward only: its mean loss on the last stage
        (None elsewhere), and no outputs (``forward_eval_outputs``: the logits stay on the
        last stage, so ``compute_metrics`` is not run and the evaluation reports the loss)."""
        if not self.stage_modules:
            raise RuntimeError(
                "PipelineTrainer.evaluate() runs inside train() (the stages are built there); "
                "set eval_strategy to evaluate during training"
            )
        inputs, targets, _ = self._inputs(batch)
        losses = self._run(inputs, targets, train=False)
        return (torch.stack(losses).mean() if self.holds_last else None), None

    # ------------------------------------------------------------------ checkpoints
    def model_component(self) -> Component:
        """This stage's own weights, loading exactly its names from a checkpoint of any split
        (or of the plain and Accelerate trainers)."""
        weights = ModelWeights(
            self.model, self.tokenizer, state_fn=self.stage_state_dict, subset=True
        )
        return replace(super().model_component(), obj=weights)

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors this stage writes: those it holds that no earlier stage holds."""
        stage = self.topology.stage
        return {k: v for k, v in self.model.state_dict().items() if self._writer.get(k) == stage}

    def load_weights(self, checkpoint: Path) -> None:
        load_model_weights(self.model, checkpoint, strict=True, subset=True)


def _member_group(rank_sets: list[list[int]]) -> Any:
    """Create a group for each rank set (every rank calls this alike); this rank's group."""
    rank, mine = dist.get_rank(), None
    for ranks in rank_sets:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _default_loss(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own causal-LM loss (Hugging Face models), else ``causal_lm_loss``."""
    function = getattr(model, "loss_function", None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if callable(function) and vocab:
        return lambda logits, labels: function(logits, labels, vocab_size=vocab)
    return causal_lm_loss
