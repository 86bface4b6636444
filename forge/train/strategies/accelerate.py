"""Hugging Face Accelerate as a strategy: the model (the last step of the model-transform stage)
and the optimizer go through ``accelerator.prepare`` (device placement, DDP, mixed precision);
backward, gradient unscaling and clipping, skipped synchronisation during accumulation and
metric reduction go through the accelerator. An accelerate config that shards parameters or
optimizer state (FSDP, DeepSpeed, Megatron-LM, a sharding parallelism config) is refused when
the trainer is built: forge's checkpoints hold the whole state, not one shard.

Two things deliberately do not: forge's learning-rate schedule and data loader are not
prepared (Accelerate's scheduler wrapper steps once per process and its loader wrapper
re-shards and re-seeds the data, which would change what a step sees and break exact
resume), and checkpoints do not use ``save_state`` (it pickles random states that
``torch.load(weights_only=True)`` refuses). The trainer's state goes through forge's
checkpoint registry like every trainer's: the weights from ``accelerator.get_state_dict``,
the optimizer keyed by parameter name, Accelerate's grad scaler as a shared component.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from forge.checkpoint import Component
from forge.checkpoint.components import model_component
from forge.train.args import SHARDING_UNSUPPORTED, TrainingArgumentsError
from forge.train.strategies.base import ParallelStrategy
from forge.wrappers import unwrap_model

#: accelerate config switches (the environment ``accelerate launch`` sets) that shard
#: parameters or optimizer state
_SHARDING = {
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}


def accelerate_config_problems(environ: Mapping[str, str]) -> list[str]:
    """What in the accelerate config (as ``accelerate launch`` passes it in ``environ``) the
    Accelerate trainer cannot honour: parameter or optimizer-state sharding (forge's
    checkpoints would hold one shard), and Accelerate's own ``torch.compile`` (forge compiles
    in its model-transform stage, before ``prepare``)."""

    def on(name: str) -> bool:
        return environ.get(name, "false").strip().lower() in ("true", "1", "yes")

    problems = [
        f"the accelerate config turns on {what} ({name}): {SHARDING_UNSUPPORTED}"
        for name, what in _SHARDING.items()
        if on(name)
    ]
    if on("ACCELERATE_USE_PARALLELISM_CONFIG"):
        sizes = {
            dim: environ.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", "1").strip() or "1"
            for dim in ("dp_shard", "tp", "cp", "sp")
        }
        sharded = [f"{dim}_size {size}" for dim, size in sizes.items() if size != "1"]
        if sharded:
            problems.append(
                f"the accelerate config's parallelism_config has {', '.join(sharded)}: "
                f"{SHARDING_UNSUPPORTED}"
            )
    backend = environ.get("ACCELERATE_DYNAMO_BACKEND", "no").strip()
    if backend.lower() not in ("", "no"):
        problems.append(
            f"the accelerate config compiles the model (dynamo_backend {backend}) after "
            "prepare, while forge compiles it in its model-transform stage before prepare; set "
            f"dynamo_backend: no there and trainer.args.torch_compile: true "
            f"(torch_compile_backend: {backend.lower()}) here"
        )
    return problems


class Accelerate(ParallelStrategy):
    """The loop's device work done by an ``accelerate.Accelerator``, created when the job
    starts (``process_group``) and ended with it."""

    #: the ``accelerate.Accelerator`` while ``train()`` / ``evaluate()`` runs, else None
    accelerator: Any = None

    # ------------------------------------------------------------------ the job
    def process_group(self) -> AbstractContextManager:
        if self.accelerator is not None:  # evaluate() inside train()
            return nullcontext(False)
        return self._accelerated()

    @contextmanager
    def _accelerated(self) -> Iterator[bool]:
        """Create the Accelerator (which starts the process group of a multi-process job);
        at the end, end the group it started so that the next job in this process starts clean."""
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.state import AcceleratorState

        args, topology = self.args, self.topology
        created_group = topology.distributed and not torch.distributed.is_initialized()
        self.accelerator = Accelerator(
            mixed_precision=getattr(args, "mixed_precision", None)
            or ("bf16" if args.bf16 else "fp16" if args.fp16 else "no"),
            # one: forge divides each micro-batch's loss by the window it belongs to (a short
            # last window too), so backward must not divide again
            gradient_accumulation_steps=1,
            cpu=self.device.type == "cpu",
            dataloader_config=DataLoaderConfiguration(
                split_batches=getattr(args, "split_batches", False)
            ),
            step_scheduler_with_optimizer=False,
            kwargs_handlers=self.accelerate_kwargs(),
        )
        accel = self.accelerator
        if accel.num_processes != topology.world_size or accel.process_index != topology.rank:
            raise RuntimeError(
                f"Accelerate sees process {accel.process_index} of {accel.num_processes}, the "
                f"launcher's environment says rank {topology.rank} of "
                f"{topology.world_size}; start the job with `forge train --nproc N`, "
                "torchrun or `accelerate launch`, not a mix"
            )
        self.device = accel.device
        try:
            yield created_group
            if created_group:
                accel.wait_for_everyone()  # no collective is still in flight
        finally:
            if created_group and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            AcceleratorState._reset_state(reset_partial_state=True)
            self.accelerator = None

    def accelerate_kwargs(self) -> list[Any]:
        """The ``ddp_*`` arguments that are set, as Accelerate's kwargs handlers."""
        from datetime import timedelta

        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

        args = self.args
        ddp = args.ddp_kwargs()
        handlers: list[Any] = [InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout))]
        if ddp:
            handlers.append(DistributedDataParallelKwargs(**ddp))
        return handlers

    def per_rank_batch_size(self, field: str) -> int:
        """With ``split_batches``, the configured batch is all processes' together."""
        args, total = self.args, getattr(self.args, field)
        if not getattr(args, "split_batches", False):
            return total
        processes = self.topology.dp_size
        if total % processes:
            raise TrainingArgumentsError(
                [
                    f"{args.config_key}.{field} {total} cannot be split evenly between "
                    f"{processes} processes (split_batches is true); use a multiple of {processes}"
                ]
            )
        return total // processes

    # ------------------------------------------------------------------ the model and optimizer
    def parallelize(self, model: nn.Module, compiled: nn.Module | None) -> nn.Module:
        """``accelerator.prepare``: device placement, DDP across processes, mixed precision
        (around the compiled module when ``torch_compile`` is on)."""
        from accelerate.utils import DistributedType

        kind = self.accelerator.distributed_type
        if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise TrainingArgumentsError([f"Accelerate runs {kind.value}: {SHARDING_UNSUPPORTED}"])
        self.wrapped = self.accelerator.prepare(model if compiled is None else compiled)
        return self.wrapped

    def prepare_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer through ``accelerator.prepare``; Accelerate's grad scaler."""
        prepared = self.accelerator.prepare(optimizer)
        self.scaler = self.accelerator.scaler
        return prepared

    def release(self) -> None:
        if self.accelerator is not None:
            self.accelerator.free_memory()
        super().release()

    # ------------------------------------------------------------------ one step
    def no_sync(self, last: bool) -> AbstractContextManager:
        """Gradients are synchronised only on a window's last micro-batch."""
        return nullcontext() if last else self.accelerator.no_sync(self.wrapped)

    def autocast(self) -> AbstractContextManager:
        return self.accelerator.autocast() if self.accelerator is not None else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)  # scales for fp16; divides by nothing (see _accelerated)

    def clip_gradients(self, model: nn.Module, optimizer: Optimizer) -> torch.Tensor:
        """Unscale (fp16) and clip through the accelerator; the norm before clipping."""
        max_norm = self.args.max_grad_norm or math.inf  # inf: measure only (clip factor 1)
        norm = self.accelerator.clip_grad_norm_(self.wrapped.parameters(), max_norm)
        if norm is None:  # DeepSpeed clips inside its step
            return torch.tensor(float("nan"))
        return norm

    def optimizer_step(self, optimizer: Optimizer) -> None:
        optimizer.step()  # Accelerate's optimizer steps and updates its grad scaler

    def inner_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The torch optimizer inside Accelerate's wrapper."""
        return getattr(optimizer, "optimizer", optimizer)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    # ------------------------------------------------------------------ checkpoints
    def model_component(self, model: nn.Module, tokenizer: Any, adapter_base: Any) -> Component:
        """The weights as ``accelerator.get_state_dict`` gathers them (a LoRA model: its
        adapter, as the plain trainer saves it)."""
        accel = self.accelerator
        return model_component(
            model,
            tokenizer,
            adapter_base=adapter_base,
            state_fn=lambda: accel.get_state_dict(unwrap_model(model)),  # the names saved
        )
