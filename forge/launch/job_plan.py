"""The plan ``forge train --dry-run`` prints: what the job would be, worked out without
building anything heavy (the model on the meta device, the training arguments, the length of
the training dataset that the preflight check builds anyway).

Parallelism is data-parallel ranks x pipeline stages; FSDP2 shards the model state over the
data-parallel ranks (each still reads its own batches), and every per-rank figure goes through
:func:`rank_memory`, which takes the shard factor. Memory is the model state only
(weights, gradients, optimizer state, the moving average of the weights with ``ema_decay``);
activations depend on the batch, and are measured on one real micro-batch only to work out the
largest per-device batch that fits a memory (``--memory``, or a GPU's: forge/launch/batch_fit.py). A LoRA run (``peft_config``) is counted
with its adapter put on the meta model: its trainable parameters are the adapter's, and its
checkpoints hold the adapter, not the frozen base. A checkpoint's size is what its files hold
(:func:`checkpoint_size`): the state's bytes, the names its files key them by, the tokenizer and
each process's loop state, so that it matches ``du`` of the directory within a few percent.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Optimizer states per trainable parameter, each the parameter's dtype (torch's optimizers).
OPTIMIZER_STATES = {
    "adamw": 2,  # exp_avg, exp_avg_sq
    "adam": 2,
    "adagrad": 1,  # sum
    "rmsprop": 1,  # square_avg (+ momentum_buffer, + grad_avg when centered)
    "sgd": 0,  # + momentum_buffer when momentum > 0
}
_OPTIM_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw"}


#: bytes per parameter of the moving average of the weights (forge.train.ema keeps fp32)
AVERAGE_BYTES = 4

# What a checkpoint's files hold besides the tensors' bytes, measured on tiny_lm's (torch 2.x,
# safetensors): each file keys a tensor by its name, and torch.save adds a zip entry per tensor.
#: optimizer.pt, per trainable tensor: its name in each state's key and each of the param
#: group's 12 settings (flattened by name), the step, and the pickle and zip entries
OPTIMIZER_KEYS_PER_TENSOR = 13  # + one per state
OPTIMIZER_ENTRY_BYTES = 1300
#: each further FSDP shard's optimizer file, per state tensor: its rows' pickle, zip entry and
#: layout (rank 0's file alone holds the settings and step counts)
SHARD_MOMENT_BYTES = 300
#: model.safetensors, per tensor: its header entry (name, dtype, shape, offsets)
WEIGHTS_ENTRY_BYTES = 64
#: ema.pt, per tensor: its name, pickle and zip entry
AVERAGE_ENTRY_BYTES = 280
#: per process: its RNG states (rng-rank-K.pt) and data position (data-rank-K.pt)
PROCESS_FILES_BYTES = 18 * 1024
#: per checkpoint: the manifest, the trainer's counters, the scheduler, the callbacks and the
#: model's config
CHECKPOINT_FILES_BYTES = 8 * 1024


@dataclass(frozen=True)
class RankMemory:
    """Bytes of model state one rank holds."""

    weights: int
    gradients: int
    optimizer: int
    average: int = 0  # the moving average of the trainable weights (ema_decay), fp32

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.average


def optimizer_states(kind: str, options: Mapping[str, Any] | None = None) -> int | None:
    """States per trainable parameter that optimizer ``kind`` keeps (``adamw_torch``, ``SGD``,
    ...), given its options (momentum, centered); None for one not known here."""
    options = options or {}
    name = _OPTIM_NAMES.get(kind, kind).lower()
    if name not in OPTIMIZER_STATES:
        return None
    states = OPTIMIZER_STATES[name]
    if name in ("sgd", "rmsprop") and float(options.get("momentum", 0) or 0) > 0:
        states += 1
    if name == "rmsprop" and options.get("centered"):
        states += 1
    return states


def rank_memory(
    held: int,
    trainable: int,
    bytes_per_param: int,
    states: int,
    *,
    shard: int = 1,
    average: bool = False,
) -> RankMemory:
    """Model state of a rank holding ``held`` parameters (``trainable`` of them trained) of
    ``bytes_per_param`` each, with ``states`` optimizer states per trainable parameter and,
    with ``average``, an fp32 moving average of each trainable parameter, the whole of it split
    ``shard`` ways (FSDP's factor; 1 without sharding)."""
    if shard < 1:
        raise ValueError(f"shard factor must be at least 1 (got {shard})")
    per = bytes_per_param
    return RankMemory(
        weights=math.ceil(held * per / shard),
        gradients=math.ceil(trainable * per / shard),
        optimizer=math.ceil(trainable * states * per / shard),
        average=math.ceil(trainable * AVERAGE_BYTES / shard) if average else 0,
    )


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def steps_per_epoch(
    dataset_size: int, batch: int, accumulation: int, dp: int, drop_last: bool
) -> int:
    """Optimizer steps in one epoch, as forge's loader and loop count them."""
    per_rank = dataset_size // dp if drop_last else math.ceil(dataset_size / dp)
    batches = per_rank // batch if drop_last else math.ceil(per_rank / batch)
    return max(math.ceil(batches / accumulation), 1)


@dataclass
class ParameterCount:
    total: int
    trainable: int
    dtype: str
    bytes_per_param: int
    per_process: list[int]  # parameters each process of one pipeline holds (one entry: no PP)
    trainable_per_process: list[int]
    adapter: bool = False  # a LoRA run's: the trainable parameters are the adapter's
    # the tensors' names, each once: the model's, and the trainable ones each process holds
    names: list[str] = field(default_factory=list)
    trainable_names: list[list[str]] = field(default_factory=list)

    @property
    def saved(self) -> int:
        """Parameters a checkpoint's weights hold: the model's, or a LoRA run's adapter."""
        return self.trainable if self.adapter else self.total

    @property
    def saved_names(self) -> list[str]:
        """The names of the tensors a checkpoint's weights hold."""
        if not self.adapter:
            return self.names
        return sorted({n for names in self.trainable_names for n in names})


def count_parameters(model: Any, pipeline_plan: Any = None) -> ParameterCount:
    """Parameters of ``model`` (a meta skeleton will do), each counted once (tied weights
    too), and what each pipeline process holds under ``pipeline_plan``."""
    import torch

    params = dict(model.named_parameters())  # one entry per tensor: ties are left out
    total = sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    dtypes: dict[torch.dtype, int] = {}
    for p in params.values():
        dtypes[p.dtype] = dtypes.get(p.dtype, 0) + p.numel()
    dtype = max(dtypes, key=dtypes.get) if dtypes else torch.float32
    size = torch.empty((), dtype=dtype).element_size()
    dtype_name = str(dtype).replace("torch.", "")
    if pipeline_plan is None:
        trained_names = [n for n, p in params.items() if p.requires_grad]
        return ParameterCount(
            total,
            trainable,
            dtype_name,
            size,
            [total],
            [trainable],
            names=list(params),
            trainable_names=[trained_names],
        )
    processes = pipeline_plan.num_processes
    held, trained = [0] * processes, [0] * processes
    names: list[list[str]] = [[] for _ in range(processes)]
    for name, param in params.items():
        ranks = pipeline_plan.shared.get(name)
        if ranks is None:
            ranks = [pipeline_plan.writer[name]] if name in pipeline_plan.writer else []
        for rank in ranks:
            held[rank] += param.numel()
            trained[rank] += param.numel() if param.requires_grad else 0
            if param.requires_grad:
                names[rank].append(name)
    return ParameterCount(
        total, trainable, dtype_name, size, held, trained, names=list(params), trainable_names=names
    )


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint's files, by what they hold."""

    weights: int  # the weights (or a LoRA run's adapter), each tensor once
    optimizer: int  # every file's: a pipeline stage's holds its tied weight's state too
    average: int  # the moving average of the weights (ema_decay); 0 without
    other: int  # the tokenizer, each process's RNG and data position, manifest and counters

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.average + self.other


def checkpoint_size(
    params: ParameterCount,
    states: int,
    *,
    processes: int,
    shard: int = 1,
    average: bool = False,
    tokenizer_bytes: int = 0,
) -> CheckpointSize:
    """What one checkpoint of a job with ``processes`` processes writes. Each stage of a
    pipeline writes the optimizer state (and moving average) of every trainable parameter it
    holds, so a tied weight's are written by both of its stages; each of ``shard`` FSDP shard
    files keys its part of every tensor by the tensor's name (what is whole on every rank,
    rank 0's alone; an HSDP replica's other ranks write nearly empty files)."""
    per = params.bytes_per_param
    trained = sum(params.trainable_per_process)
    trained_names = [n for names in params.trainable_names for n in names]
    weights = params.saved * per + shard * sum(
        WEIGHTS_ENTRY_BYTES + len(n) for n in params.saved_names
    )
    optimizer = trained * states * per + sum(
        OPTIMIZER_ENTRY_BYTES + (OPTIMIZER_KEYS_PER_TENSOR + states) * len(n) for n in trained_names
    )
    optimizer += (shard - 1) * states * sum(SHARD_MOMENT_BYTES + len(n) for n in trained_names)
    moving = 0
    if average:
        moving = trained * AVERAGE_BYTES + shard * sum(
            AVERAGE_ENTRY_BYTES + len(n) for n in trained_names
        )
    other = tokenizer_bytes + processes * PROCESS_FILES_BYTES + CHECKPOINT_FILES_BYTES
    return CheckpointSize(weights, optimizer, moving, other)


def describe_plan(
    *,
    trainer: str,
    world_size: int,
    nnodes: int,
    pp: int,
    shard: int,
    args: Any,
    dataset_size: int | None,
    mesh: tuple[int, int] | None = None,
    params: ParameterCount | None,
    optimizer: tuple[str, int | None],
    checkpoints_dir: str,
    tokenizer_bytes: int = 0,
    batch_fit: Any = None,
    resumed: str | None = None,
) -> list[str]:
    """The plan as lines (stdout): one topic a line, figures a person can check by hand.
    ``tokenizer_bytes``: what the tokenizer's files take in a checkpoint; ``batch_fit``: the
    memory and measured activations the largest per-device batch is worked out from
    (forge/launch/batch_fit.py), None for no such line; ``resumed``: what starting from a
    checkpoint of another data-parallel size does to the data and the batch."""
    replicas = world_size // pp  # the ranks that read their own batches (sharded ones too)
    sharded = f" (FSDP2: the model state sharded over {shard})" if shard > 1 else ""
    if shard > 1 and pp > 1:
        sharded = f" (FSDP2: each stage's state sharded over its {shard} replicas)"
    if mesh is not None:
        sharded = (
            f" (HSDP: a {mesh[0]} x {mesh[1]} mesh, {mesh[0]} replica(s) of the model state "
            f"sharded over {mesh[1]})"
        )
    stages = "pipeline stage" if pp == 1 else "pipeline stages"
    where = f"{nnodes} nodes" if nnodes > 1 else "1 node"
    lines = [
        "plan:",
        f"  trainer       {trainer}",
        f"  parallelism   {replicas} data-parallel{sharded} x {pp} {stages} = {world_size} "
        f"process(es) on {where}",
    ]
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    lines.append(
        f"  batch         {batch} per device x {accumulation} accumulation x {replicas} data-parallel"
        f" = {batch * accumulation * replicas} per optimizer step"
    )
    if resumed:
        lines.append(f"  resume        {resumed}")
    if dataset_size is not None:
        per_epoch = steps_per_epoch(
            dataset_size, batch, accumulation, replicas, bool(args.dataloader_drop_last)
        )
        if args.max_steps > 0:
            total, how = args.max_steps, "max_steps"
            epochs = math.ceil(total / per_epoch)
        else:
            total = math.ceil(args.num_train_epochs * per_epoch)
            how, epochs = (
                f"num_train_epochs {args.num_train_epochs:g}",
                math.ceil(args.num_train_epochs),
            )
        lines.append(
            f"  steps         {per_epoch} per epoch ({dataset_size} training items); {total} in "
            f"all ({how}), {epochs} epoch(s)"
        )
    else:
        total = args.max_steps if args.max_steps > 0 else None
        lines.append(
            "  steps         the training dataset has no length (a stream): max_steps decides; "
            "a resume continues at the position saved (forge runs shows it)"
        )
    kind, states = optimizer
    if params is None:
        lines.append("  parameters    not counted: the model cannot be built on the meta device")
        return lines + _checkpoint_lines(args, total, None, checkpoints_dir)
    per_rank = ", ".join(f"{n:,}" for n in params.per_process)
    split = f"; per pipeline stage process {per_rank}" if pp > 1 else ""
    adapter = "; LoRA: the adapter's" if params.adapter else ""
    lines.append(
        f"  parameters    {params.total:,} total, {params.trainable:,} trainable "
        f"({params.dtype}{adapter}){split}"
    )
    average = bool(getattr(args, "ema_decay", None))  # forge.train.ema: 0 or null is off
    if states is None:
        lines.append(f"  memory/rank   optimizer {kind}: its state size is not known to forge")
        return lines + _checkpoint_lines(args, total, None, checkpoints_dir)
    memories = [
        rank_memory(held, trained, params.bytes_per_param, states, shard=shard, average=average)
        for held, trained in zip(params.per_process, params.trainable_per_process, strict=True)
    ]
    top = max(memories, key=lambda m: m.total)
    averaged = f" + moving average {human_bytes(top.average)} (fp32)" if average else ""
    lines.append(
        f"  memory/rank   weights {human_bytes(top.weights)} + gradients "
        f"{human_bytes(top.gradients)} + optimizer {human_bytes(top.optimizer)} ({kind}: "
        f"{states} state(s) per parameter){averaged} = {human_bytes(top.total)}"
        + (" on the largest stage" if len(memories) > 1 else "")
        + "; activations not counted"
    )
    if batch_fit is not None:
        lines.append(batch_fit.line(top.total))
    saved = checkpoint_size(
        params,
        states,
        processes=world_size,
        shard=shard,
        average=average,
        tokenizer_bytes=tokenizer_bytes,
    )
    if shard > 1 and args.save_strategy != "no":
        lines.append(_sharded_layout(saved, world_size, pp))
    return lines + _checkpoint_lines(args, total, saved, checkpoints_dir, params.adapter)


def _sharded_layout(saved: CheckpointSize, world_size: int, pp: int) -> str:
    """The layout line of a sharded job's checkpoints: every rank writes its own shard of the
    weights, optimizer state (and moving average), a pipeline stage's ranks their stage's."""
    names = ["model-shard-RRRRR-of-{w}.safetensors", "optimizer-shard-RRRRR-of-{w}.pt"]
    if saved.average:
        names.append("ema-shard-RRRRR-of-{w}.pt")
    files = ", ".join(n.format(w=f"{world_size:05d}") for n in names)
    whose = "its rows of its stage's state" if pp > 1 else "its rows of the state"
    share = (saved.weights + saved.optimizer + saved.average) / world_size
    return f"  layout        each rank writes {whose} ({files}): about {human_bytes(share)}"


def _checkpoint_lines(
    args: Any,
    total_steps: int | None,
    saved: CheckpointSize | None,
    checkpoints_dir: str,
    adapter: bool = False,
) -> list[str]:
    """The checkpoints line: their size (the weights, or a LoRA run's adapter, the optimizer
    state, the moving average of the weights, the tokenizer and loop state; no gradients),
    how often, where."""
    if args.save_strategy == "no":
        return [f"  checkpoints   none (save_strategy: no); the run directory is {checkpoints_dir}"]
    size = ""
    if saved is not None:
        weights = "the adapter" if adapter else "weights"
        averaged = f" + moving average {human_bytes(saved.average)}" if saved.average else ""
        size = (
            f"about {human_bytes(saved.total)} each ({weights} {human_bytes(saved.weights)}"
            f" + optimizer {human_bytes(saved.optimizer)}{averaged} + tokenizer and loop state "
            f"{human_bytes(saved.other)}), "
        )
    when = f"every {args.save_steps} steps" if args.save_strategy == "steps" else "every epoch"
    saves = ""
    if args.save_strategy == "steps" and total_steps:
        count = total_steps // args.save_steps if args.save_steps >= 1 else None
        if count is not None:
            saves = f" ({count} save(s)"
            saves += f", {args.save_total_limit} kept)" if args.save_total_limit else ")"
    return [f"  checkpoints   {size}{when}{saves}, in {checkpoints_dir}"]


def make_plan(
    cfg: Any,
    variables: Mapping[str, Any],
    allow: list[str],
    *,
    world_size: int,
    nnodes: int,
    checkpoints_dir: str,
    memory: int | None = None,
) -> list[str]:
    """The plan of ``cfg`` (checked already) trained by ``world_size`` processes. With
    ``memory`` (bytes; else a GPU's, where there is one) it also gives the largest per-device
    batch that fits, from activations measured on one real micro-batch."""
    import torch
    from torch import nn

    from forge.config.build import Materializer
    from forge.config.graph import CallNode
    from forge.launch.preflight import _resolver

    trainer = cfg.targets.get("trainer")
    if not isinstance(trainer, CallNode) or not isinstance(trainer.kwargs.get("args"), CallNode):
        return ["plan: not made (the trainer is not built from keyword arguments)"]
    resolver = _resolver(cfg, allow)

    def build(node: Any) -> Any:
        return Materializer(resolver.resolve, variables, cfg.describe_loc).value(node)

    trainer_class = resolver.resolve(trainer.spec)
    args = build(trainer.kwargs["args"])
    pp, pipeline = 1, None
    model = None
    peft_node = trainer.kwargs.get("peft_config")
    try:
        model = _meta_model(build, trainer.kwargs.get("model"))
        if peft_node is not None:  # the adapter step, as the trainer takes it (the base frozen)
            from forge.train.lora import apply_lora

            with torch.device("meta"):
                model = apply_lora(model, build(peft_node))
    except Exception as err:  # a model that reads weights or cannot run on meta
        logger.debug("model not built on the meta device (%s: %s)", type(err).__name__, err)
        model = None
    if callable(getattr(trainer_class, "plan_job", None)) and hasattr(
        args, "pipeline_parallel_size"
    ):
        pp = args.pipeline_parallel_size or world_size
        if model is not None:
            from forge.train.pipeline.plan import plan_pipeline

            try:
                pipeline = plan_pipeline(model, args, world_size)
            except Exception as err:  # reported by the preflight check already
                logger.debug("no pipeline plan (%s)", err)
    dataset_size = None
    dataset_node = trainer.kwargs.get("train_dataset")
    try:
        dataset_size = len(build(dataset_node)) if dataset_node is not None else None
    except TypeError:  # an iterable dataset
        dataset_size = None
    params = count_parameters(model, pipeline) if isinstance(model, nn.Module) else None
    if params is not None and peft_node is not None:
        params.adapter = True
    shard, mesh = 1, None
    settings = getattr(args, "fsdp_settings", None)
    sharding = settings() if callable(settings) else None
    if world_size // pp > 1 and sharding is not None:
        shard = world_size // pp  # FSDP2 shards over every data-parallel rank (of a stage)
        if sharding.hybrid and pp == 1:  # HSDP: over the ranks of one replica
            mesh = sharding.hybrid_mesh(world_size, world_size // max(nnodes, 1))
            shard = mesh[1]
    how = (
        "pipeline stages x FSDP2 shards"
        if pp > 1 and shard > 1
        else "pipeline stages"
        if pp > 1
        else "hybrid sharded data parallel, FSDP2 (HSDP)"
        if mesh is not None
        else "sharded data parallel, FSDP2"
        if shard > 1
        else "data parallel"
        if world_size > 1
        else "one process"
    )
    name = f"{trainer.spec} ({how})"
    fit = _batch_fit(build, trainer, args, memory) if pp == 1 and params is not None else None
    return describe_plan(
        trainer=name,
        world_size=world_size,
        nnodes=nnodes,
        pp=pp,
        shard=shard,
        mesh=mesh,
        args=args,
        dataset_size=dataset_size,
        params=params,
        optimizer=_optimizer(trainer.kwargs.get("optimizer"), args),
        checkpoints_dir=checkpoints_dir,
        tokenizer_bytes=_tokenizer_bytes(build, trainer.kwargs.get("tokenizer")),
        batch_fit=fit,
        resumed=_reshaped_resume(args, world_size // pp),
    )


def _reshaped_resume(args: Any, replicas: int) -> str | None:
    """For a run that starts from a checkpoint (a path) of another data-parallel size: where
    its epoch goes on and the global batch it had; None otherwise."""
    path = getattr(args, "resume_from_checkpoint", None)
    if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "manifest.json")):
        return None
    from forge.checkpoint import CheckpointError
    from forge.checkpoint.layout import read_manifest
    from forge.checkpoint.registry import read_component_states, saved_dp_size
    from forge.train.data_position import StepBatch

    try:
        saved = saved_dp_size(read_manifest(path).topology)
        if saved == replicas:
            return None
        states = read_component_states(path, "data") or [{}]
    except (CheckpointError, OSError) as err:
        logger.debug("no resume line (%s)", err)
        return None
    step = states[0].get("step_batch") if isinstance(states[0], dict) else None
    was = f"; its global batch was {StepBatch(**step).describe()}" if step else ""
    return (
        f"{os.path.basename(os.path.normpath(path))} was written by {saved} data-parallel "
        f"rank(s): the rest of its epoch is dealt to these {replicas}{was}"
    )


def _batch_fit(build: Any, trainer: Any, args: Any, memory: int | None) -> Any:
    """The memory to fit (``--memory``, else the GPU's) and one real micro-batch's activations;
    nothing is built for real without a memory to fit."""
    from forge.launch.batch_fit import BatchFit, device_memory, measure_micro_batch

    source = "--memory"
    if memory is None:
        memory, source = device_memory(), "the GPU's"
    if memory is None:
        return BatchFit(None, "", "")
    try:
        activations: Any = measure_micro_batch(build, trainer, args)
    except Exception as err:  # the plan goes on without it
        logger.debug("activations not measured", exc_info=True)
        activations = f"one micro-batch's forward and backward failed: {type(err).__name__}: {err}"
    return BatchFit(memory, source, activations)


def _tokenizer_bytes(build: Any, node: Any) -> int:
    """What the trainer's tokenizer writes into each checkpoint (``save_pretrained``, as the
    checkpoint does, into a temporary directory); 0 without one, or one that cannot be built."""
    import tempfile
    from pathlib import Path

    if node is None:
        return 0
    try:
        tokenizer = build(node)
        if not callable(getattr(tokenizer, "save_pretrained", None)):
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            return sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    except Exception as err:  # the plan goes on without it: a few hundred KiB at most
        logger.debug("tokenizer not measured (%s: %s)", type(err).__name__, err)
        return 0


def _meta_model(build: Any, node: Any) -> Any:
    """The trainer's model on the meta device: a LoRA base read from a directory
    (``forge.train.lora:load_base_model``) from its config alone, any other as the config
    builds it."""
    import torch
    from torch import nn

    from forge.config.graph import CallNode

    if isinstance(node, CallNode) and node.spec == "forge.train.lora:load_base_model":
        from forge.train.lora import base_skeleton

        given = node.kwargs.get("path", node.args[0] if node.args else None)
        return base_skeleton(build(given) if given is not None else None)
    with torch.device("meta"):
        model = build(node)
        return model if isinstance(model, nn.Module) else model()


def _optimizer(node: Any, args: Any) -> tuple[str, int | None]:
    """The optimizer's name and its states per parameter: a ``!partial`` the config gives,
    else the one ``args.optim`` names."""
    from forge.config.graph import CallNode

    if isinstance(node, CallNode):
        kind = node.spec.rpartition(":")[2].rpartition(".")[2]
        options = {k: v for k, v in node.kwargs.items() if isinstance(v, (int, float, bool))}
        return kind, optimizer_states(kind, options)
    if node is not None:
        return "the config's", None
    options = args.parsed_optim_args() if hasattr(args, "parsed_optim_args") else {}
    return args.optim, optimizer_states(args.optim, options)
