"""Pipeline parallelism as a strategy: the model split into stages across processes, each stage
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

With ``fsdp`` (``full_shard`` or ``shard_grad_op``) each stage is sharded over its replicas
instead of replicated, as torchtitan composes the two: the ranks of a stage form one dimension
of a (replicas x stages) device mesh, FSDP2 shards the stage's layers one by one and then the
stage module as the root, and the schedule drives the gradient reduce-scatter (once per
batch, after the last microbatch's backward). Each rank then saves its rows of its stage's
weights, optimizer state and average (checkpoint scope ``sharded``).

Every rank loads the same batches as the other stages of its replica: stage 0 reads the
input ids, the last stage the labels. The split itself (which modules each stage holds, how a
stage builds only its part, the presets of known model families) is forge/train/pipeline/.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from forge.checkpoint import Component, Scope, load_model_weights
from forge.checkpoint.adapter import StageAdapterWeights, load_stage_adapter
from forge.checkpoint.components import model_component, optimizer_component
from forge.train.args import TrainingArguments
from forge.train.args.fsdp import FsdpSettings
from forge.train.loop_state import Batch, count_tokens
from forge.train.pipeline.plan import PipelinePlan
from forge.train.pipeline.split import StageModule, causal_lm_loss, prune_to_stages
from forge.train.pipeline.stage_init import build_partial_model, free_except
from forge.train.strategies.base import MicroLoss, ParallelStrategy
from forge.train.strategies.fsdp import apply_fully_shard, global_norm
from forge.train.topology import Topology
from forge.wrappers import class_label, is_peft_model, unwrap_model

_BATCH_KEYS = {"input_ids", "labels", "attention_mask"}

UNSUPPORTED = {
    "compute_loss_func": (
        "the pipeline trainer computes the loss on its last stage, which holds the "
        "logits, not the model's outputs; give it loss_fn(logits, labels) instead"
    ),
}


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


class Pipeline(ParallelStrategy):
    """This rank's stages of ``plan`` (forge/train/pipeline/plan.py), times data-parallel
    replicas. ``loss_fn(logits, labels)`` replaces the model's own causal-LM loss; with
    ``settings`` (FSDP2) each stage is sharded over its replicas."""

    unsupported_arguments = UNSUPPORTED
    gives_eval_outputs = False  # the logits stay on the last stage
    computes_loss = True

    def __init__(
        self,
        args: TrainingArguments,
        topology: Topology,
        device: torch.device,
        plan: PipelinePlan,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        settings: FsdpSettings | None = None,
    ) -> None:
        super().__init__(args, topology, device)
        self.plan = plan
        # one replica per stage has nothing to shard over: the stage stays whole
        self.settings = settings if topology.dp_size > 1 else None
        self.layout = plan.layout
        self.loss_fn = loss_fn
        self.num_microbatches = plan.num_microbatches
        # built by parallelize()
        self.stage_modules: list[StageModule] = []
        self._schedules: dict[tuple, Any] = {}
        self._groups: dict[str, Any] = {}
        self._loss: _MicrobatchLoss | None = None
        self._model: nn.Module | None = None
        self._fresh = False  # a schedule was just built: its first step infers shapes
        # LoRA: the adapter step wraps the model with the other stages' parts still there (on
        # the meta device), so each layer's adapter draws the random numbers it draws in one
        # process; the trainer removes the parts this rank does not hold after it (prune())
        self.prune_after_adapter = False

    @property
    def my_stages(self):
        return self.layout.rank_stages(self.topology.stage)

    @property
    def holds_first(self) -> bool:
        return any(spec.first for spec in self.my_stages)

    @property
    def holds_last(self) -> bool:
        return any(spec.last for spec in self.my_stages)

    # ------------------------------------------------------------------ the model-transform stage
    def build_model(
        self, given: nn.Module | None, model_init: Callable[[], nn.Module]
    ) -> nn.Module:
        """This rank's stages only: from a builder the other parts are never materialised
        (forge/train/pipeline/stage_init.py); a whole module given to the trainer has their
        weights freed. Either way the parts no stage of this rank holds are removed."""
        kept = self.layout.rank_modules(self.topology.stage)
        if given is not None:
            model = given
            free_except(model, kept)
        else:
            model = build_partial_model(model_init, kept)
            if not isinstance(model, nn.Module):
                raise TypeError(
                    f"trainer.model built a {class_label(model)}, not an nn.Module; pass a "
                    "module or a callable (e.g. !partial) that returns one"
                )
        if not self.prune_after_adapter:
            self.prune(model)
        return model

    def prune(self, model: nn.Module) -> None:
        """Remove the parts of ``model`` (or of the model a peft model wraps) that no stage of
        this rank holds."""
        base = unwrap_model(model, through_adapters=True)
        prune_to_stages(base, self.layout.parts, self.my_stages)

    def activation_checkpointing_scope(self) -> dict[str, Any]:
        """The stage's layers by default; named blocks other stages hold are theirs (checked
        against the whole model when the trainer was built)."""
        return {"layers": self.layout.parts.layers, "names_checked": True}

    def parallelize(self, model: nn.Module, compiled: nn.Module | None) -> nn.Module:
        """The stage modules, the process groups and the last stage's loss; the model itself
        is what the loop puts in train() / eval() mode."""
        self._model = model
        base = unwrap_model(model, through_adapters=True)  # a LoRA stage: its adapted layers
        self.stage_modules = [StageModule(base, self.layout.parts, s) for s in self.my_stages]
        self._loss = _MicrobatchLoss(self.loss_fn or self._default_loss(base))
        self._schedules = {}
        self._make_groups()
        for line in self.plan.describe():
            self.info("%s", line)
        if self.sharded:
            self._shard_stages(model)
        self.wrapped = model
        return model

    @property
    def sharded(self) -> bool:
        """Whether each stage is sharded over its replicas (pipeline x FSDP)."""
        return self.settings is not None

    def _shard_stages(self, model: nn.Module) -> None:
        """FSDP2 on this rank's stage over the ranks of that stage (one per replica): its
        layers one by one, then the stage module as the root the schedule drives. A tensor the
        model holds outside the stage module under another name (an input embedding kept on
        the last stage for the head tied to it) is pointed at the sharded parameter."""
        from torch.distributed.device_mesh import init_device_mesh

        topo = self.topology
        # rank = replica * stages + stage: the inner dimension walks a replica's stages
        mesh = init_device_mesh(
            self.device.type, (topo.dp_size, topo.num_stages), mesh_dim_names=("shard", "pp")
        )["shard"]
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    holders.setdefault(id(param), []).append((module, attr))
        for module in self.stage_modules:
            line = apply_fully_shard(module, self.settings, self.device, self.args, mesh=mesh)
        for places in holders.values():
            held = [module._parameters[attr] for module, attr in places]
            sharded = [p for p in held if _is_dtensor(p)]
            for (module, attr), param in zip(places, held, strict=True):
                if sharded and param is not sharded[0]:
                    module._parameters[attr] = sharded[0]
        self.info("each stage: %s", line.replace(" and the root", " and the stage module"))

    def _default_loss(
        self, model: nn.Module
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The model's own loss, or with ``label_smoothing_factor`` the smoothed cross-entropy
        the other trainers compute (Hugging Face's ``LabelSmoother``, labels shifted for a
        causal LM)."""
        epsilon = self.args.label_smoothing_factor
        if not epsilon:
            return model_loss_function(model)
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
        for ranks in sorted({tuple(r) for r in self.plan.shared.values()}):
            name = f"shared-{'-'.join(map(str, ranks))}"
            sets = [[d * topo.num_stages + r for r in ranks] for d in range(topo.dp_size)]
            group = _member_group(sets)
            if topo.stage in ranks:
                groups[name] = group
        self._groups = groups

    def release(self) -> None:
        self._schedules = {}
        self.stage_modules = []
        for group in self._groups.values():
            if dist.is_initialized():
                dist.destroy_process_group(group)
        self._groups = {}
        super().release()

    # ------------------------------------------------------------------ one step
    def forward_backward(
        self, window: list[Batch], micro_loss: MicroLoss
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each micro-batch through the pipeline (the last stage computes the loss; the
        trainer's ``micro_loss`` is not used); (mean loss, tokens) on the last stage (zero
        elsewhere, so the loop's sum over ranks counts each replica once)."""
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.long, device=self.device)
        for batch in window:
            inputs, labels = self.inputs(batch)
            losses = self._run(inputs, labels, train=True, weight=1.0 / len(window))
            if self.holds_last:
                loss_sum += torch.stack(losses).mean() / len(window)
                tokens += torch.as_tensor(count_tokens(batch), device=self.device)
        self._sync_gradients()
        return loss_sum, tokens

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids the first stage reads and the labels the last stage's loss reads;
        a batch the stages cannot take is refused with the reason."""
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
        return batch["input_ids"], batch["labels"]

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
        kept = self._kept_gradients() if train and self._fresh else {}
        self._fresh = False
        with self.autocast():
            if train:
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                schedule.eval(*args, target=target, losses=losses, return_outputs=False)
        for param, grad in kept.items():  # the accumulation so far, on top of this batch's
            param.grad = grad if param.grad is None else param.grad + grad
        return self._loss.take(count) if self.holds_last else []

    def _kept_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """A new schedule's first step infers the stage's shapes with a real forward and
        backward, after which it drops a sharded stage's gradients: those accumulated by the
        window's earlier batches are taken out here and added back after the step."""
        if not self.sharded:
            return {}
        kept = {p: p.grad for p in self._model.parameters() if p.grad is not None}
        for param in kept:
            param.grad = None
        return kept

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
        sized by its first microbatch). A short last batch splits into fewer microbatches.

        A sharded stage's forwards gather its parameters with its replicas, so the replicas
        run as many microbatches and build their schedules (whose first step infers the
        shapes with a real forward) at the same batches: both follow every replica's shape."""
        shapes = self._replica_shapes(shape) if self.sharded else [shape]
        count = max(
            d
            for d in range(1, self.num_microbatches + 1)
            if self.num_microbatches % d == 0 and all(s[0] % d == 0 for s in shapes)
        )
        key = (train, shape, *shapes)
        if key not in self._schedules:
            self._schedules[key] = self._make_schedule(count, train)
            self._fresh = True
        return self._schedules[key], count

    def _replica_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The batch shape of every replica of this stage (a collective over them)."""
        mine = torch.tensor(shape, dtype=torch.long, device=self.device)
        every = torch.empty(
            self.topology.dp_size * len(shape), dtype=torch.long, device=mine.device
        )
        dist.all_gather_into_tensor(every, mine, group=self._groups["replicas"])
        return [tuple(row) for row in every.view(self.topology.dp_size, -1).tolist()]

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
        """Average over the replicas of this stage (a sharded stage's were reduce-scattered
        by the schedule already); sum a tied weight over its stages."""
        model = self._model
        replicas = self._groups.get("replicas")
        if replicas is not None:
            grads = [
                p.grad for p in model.parameters() if p.grad is not None and not _is_dtensor(p)
            ]
            if grads:
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=replicas)
                flat /= self.topology.dp_size
                for grad, synced in zip(
                    grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
                ):
                    grad.copy_(synced)
        params = dict(model.named_parameters())
        for name, ranks in self.plan.shared.items():
            group = self._groups.get(f"shared-{'-'.join(map(str, ranks))}")
            grad = params[name].grad if name in params else None
            if group is not None and grad is not None:
                # a sharded stage's rows: both stages shard the weight alike over their replicas
                dist.all_reduce(_local(grad), group=group)

    def clip_gradients(self, model: nn.Module, optimizer: Optimizer) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (a shared weight counted once)."""
        stage, shared = self.topology.stage, self.plan.shared
        own = [
            p.grad
            for name, p in model.named_parameters()
            if p.grad is not None and shared.get(name, [stage])[0] == stage
        ]
        if self.sharded:  # the stage's norm over its shards: a DTensor norm, made whole
            norm = global_norm(torch.nn.utils.get_total_norm(own)) if own else None
        else:
            norm = torch.nn.utils.get_total_norm(own) if own else None
        if norm is None:
            norm = torch.zeros((), device=self.device)
        squares = norm.double().square()
        if "pipeline" in self._groups:
            dist.all_reduce(squares, group=self._groups["pipeline"])
        total = squares.sqrt().to(norm.dtype)
        if self.args.max_grad_norm:
            params = [p for p in model.parameters() if p.grad is not None]
            if self.sharded:  # each rank scales its rows by the one coefficient
                scale = (self.args.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_([_local(p.grad) for p in params], scale)
            else:
                torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, total)
        return total

    # ------------------------------------------------------------------ evaluation
    def eval_forwards(self, count: int) -> int:
        """A sharded stage's forward gathers parameters with its replicas: every rank runs as
        many evaluation forwards as the rank with the most batches."""
        return int(self.agree_max(float(count))) if self.sharded else count

    def forward_eval(
        self, batch: Batch, forward: Callable[[], tuple[torch.Tensor | None, Any]]
    ) -> tuple[torch.Tensor | None, Any]:
        """The batch through the pipeline, forward only: its mean loss on the last stage
        (None elsewhere), and no outputs (the logits stay on the last stage, so
        ``compute_metrics`` is not run and the evaluation reports the loss)."""
        if not self.stage_modules:
            raise RuntimeError(
                "PipelineTrainer.evaluate() runs inside train() (the stages are built there); "
                "set eval_strategy to evaluate during training"
            )
        inputs, targets = self.inputs(batch)
        losses = self._run(inputs, targets, train=False)
        for module in self.stage_modules if self.sharded else ():
            # a forward without backward leaves the stage root's parameters gathered: freed
            # here, so weights swapped in or out (an average) are gathered afresh
            module.reshard()
        return (torch.stack(losses).mean() if self.holds_last else None), None

    # ------------------------------------------------------------------ checkpoints
    def model_component(self, model: nn.Module, tokenizer: Any, adapter_base: Any) -> Component:
        """This stage's own weights, loading exactly its names from a checkpoint of any split
        (or of the plain and Accelerate trainers); sharded, each rank its rows of them. Of a
        LoRA stage the adapter: every stage's part gathered, written whole by rank 0."""
        if is_peft_model(model):
            weights = StageAdapterWeights(model, tokenizer, adapter_base, _gather_union)
            return Component("model", weights, Scope.SHARED, weights=True)
        if self.sharded:
            return model_component(
                model,
                tokenizer,
                sharded=True,
                state_fn=lambda: self._own_state(model.state_dict()),
                keeps_whole=self.topology.dp_rank == 0,
            )
        return model_component(
            model, tokenizer, state_fn=lambda: self.stage_state_dict(model), subset=True
        )

    def optimizer_component(self, model: nn.Module, optimizer: Optimizer) -> Component:
        """The stage's optimizer state keyed by parameter name; sharded, each rank its rows."""
        if not self.sharded:
            return super().optimizer_component(model, optimizer)
        return optimizer_component(
            model,
            optimizer,
            sharded=True,
            keeps_whole=self.topology.dp_rank == 0,
            **self.optimizer_flags(),
        )

    def stage_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The tensors this stage writes: those it holds that no earlier stage holds (a
        sharded stage's gathered whole: every rank of the stage must call this)."""
        state = self._own_state(model.state_dict())
        if self.sharded:
            state = {k: v.full_tensor() if _is_dtensor(v) else v for k, v in state.items()}
        return state

    def _own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        stage, writer = self.topology.stage, self.plan.writer
        return {k: v for k, v in state.items() if writer.get(k) == stage}

    def load_weights(self, model: nn.Module, checkpoint: Path) -> None:
        if is_peft_model(model):
            load_stage_adapter(model, checkpoint)
            return
        load_model_weights(model, checkpoint, strict=True, subset=True)


def _gather_union(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``state`` in one (a collective; replicas give the same tensors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return state
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state)
    return {k: v for part in parts for k, v in part.items()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (its memory), or the tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _member_group(rank_sets: list[list[int]]) -> Any:
    """Create a group for each rank set (every rank calls this alike); this rank's group."""
    rank, mine = dist.get_rank(), None
    for ranks in rank_sets:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def model_loss_function(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own causal-LM loss (Hugging Face models), else ``causal_lm_loss``."""
    function = getattr(model, "loss_function", None)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if callable(function) and vocab:
        return lambda logits, labels: function(logits, labels, vocab_size=vocab)
    return causal_lm_loss
