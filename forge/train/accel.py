"""The Accelerate trainer: the shared loop with Hugging Face Accelerate doing the device work.

The model (the last step of the model-transform stage, ``parallelize``) and the optimizer go
through ``accelerator.prepare`` (device placement, DDP, mixed precision); backward, gradient
unscaling and clipping, skipped synchronisation during accumulation, metric reduction and
main-process checks go through the accelerator. An accelerate config that shards parameters
or optimizer state (FSDP, DeepSpeed, Megatron-LM, a sharding parallelism config) is refused
when the trainer is built: forge's checkpoints hold the whole state, not one shard.

Two things deliberately do not: forge's learning-rate schedule and data loader are not
prepared (Accelerate's scheduler wrapper steps once per process and its loader wrapper
re-shards and re-seeds the data, which would change what a step sees and break exact
resume), and checkpoints do not use ``save_state`` (it pickles random states that
``torch.load(weights_only=True)`` refuses). The trainer's state goes through forge's
checkpoint registry like every trainer's: the weights from ``accelerator.get_state_dict``,
the optimizer keyed by parameter name, Accelerate's grad scaler as a shared component.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from forge.checkpoint import Component, ModelWeights, OptimizerState
from forge.train.args import SHARDING_UNSUPPORTED, TrainingArguments, TrainingArgumentsError
from forge.train.base import BaseTrainer
from forge.train.optim import build_optimizer
from forge.wrappers import is_peft_model

logger = logging.getLogger(__name__)

MIXED_PRECISION = ("no", "fp16", "bf16")


@dataclass
class AccelTrainingArguments(TrainingArguments):
    """TrainingArguments plus Accelerate's own settings.

    ``mixed_precision`` (``no``, ``fp16``, ``bf16``) defaults to what ``bf16`` / ``fp16``
    say. ``split_batches``: ``per_device_train_batch_size`` (and the eval one) is the batch of
    all processes together, split evenly between them (Accelerate's meaning), instead of each
    process's. ``dispatch_batches`` is Accelerate's option for iterable datasets read on the main
    process; forge's datasets are map-style and each process reads its own shard, so only
    null / false apply.
    """

    mixed_precision: str | None = None
    split_batches: bool = False
    dispatch_batches: bool | None = None

    def validate(self) -> list[str]:
        p = super().validate()
        for name in ("fsdp", "fsdp_config"):
            if getattr(self, name) not in (None, "", False, [], {}):
                p.append(
                    f"{self._key(name)} does not apply to this trainer: {SHARDING_UNSUPPORTED}"
                )
        self._bool("split_batches", p)
        if self.mixed_precision is None:
            self.mixed_precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "no"
        elif self.mixed_precision not in MIXED_PRECISION:
            self._choice("mixed_precision", MIXED_PRECISION, p, fix="or null to follow bf16/fp16")
        else:
            implied = "bf16" if self.bf16 else "fp16" if self.fp16 else None
            if implied is not None and implied != self.mixed_precision:
                p.append(
                    f"{self._key('mixed_precision')} is {self.mixed_precision!r} but "
                    f"{self._key(implied)} is true; set one of them"
                )
            self.bf16 = self.mixed_precision == "bf16"
            self.fp16 = self.mixed_precision == "fp16"
        if self.dispatch_batches not in (None, False):
            p.append(
                f"{self._key('dispatch_batches')} must be null or false (got "
                f"{self.dispatch_batches!r}): forge's datasets are map-style and every process "
                "reads its own shard"
            )
        return p


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


class AccelTrainer(BaseTrainer):
    """Train with Hugging Face Accelerate, in one process or under ``torchrun`` /
    ``accelerate launch`` (the ranks come from the environment either sets).

    ``args`` may be ``AccelTrainingArguments`` (mixed precision, ``split_batches``) or plain
    ``TrainingArguments``. See ``BaseTrainer`` for the other arguments.
    """

    trainer_kind: ClassVar[str] = "accelerate"

    #: the ``accelerate.Accelerator`` while ``train()`` / ``evaluate()`` runs, else None
    accelerator: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        problems = accelerate_config_problems(os.environ)
        if problems:
            raise TrainingArgumentsError(problems)
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ process group
    @contextmanager
    def _accelerated(self) -> Iterator[bool]:
        """Create the Accelerator (which starts the process group of a multi-process job);
        at the end, end the group it started so that the next job in this process starts clean."""
        from accelerate import Accelerator, DataLoaderConfiguration
        from accelerate.state import AcceleratorState

        args = self.args
        created_group = self.topology.distributed and not torch.distributed.is_initialized()
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
            kwargs_handlers=self._accelerate_kwargs(),
        )
        accel = self.accelerator
        if accel.num_processes != self.topology.world_size or (
            accel.process_index != self.topology.rank
        ):
            raise RuntimeError(
                f"Accelerate sees process {accel.process_index} of {accel.num_processes}, the "
                f"launcher's environment says rank {self.topology.rank} of "
                f"{self.topology.world_size}; start the job with `forge train --nproc N`, "
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

    def _accelerate_kwargs(self) -> list[Any]:
        """The ``ddp_*`` arguments that are set, as Accelerate's kwargs handlers."""
        from datetime import timedelta

        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

        args = self.args
        ddp = args.ddp_kwargs()
        handlers: list[Any] = [InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout))]
        if ddp:
            handlers.append(DistributedDataParallelKwargs(**ddp))
        return handlers

    def distributed(self) -> AbstractContextManager:
        if self.accelerator is not None:  # evaluate() inside train()
            return nullcontext(False)
        return self._accelerated()

    @property
    def is_main_process(self) -> bool:
        if self.accelerator is not None:
            return self.accelerator.is_main_process
        return self.topology.is_main

    # ------------------------------------------------------------------ setup
    def parallelize(self, model: nn.Module) -> nn.Module:
        """``accelerator.prepare``: device placement, DDP across processes, mixed precision
        (around the compiled module when ``torch_compile`` is on)."""
        from accelerate.utils import DistributedType

        kind = self.accelerator.distributed_type
        if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise TrainingArgumentsError([f"Accelerate runs {kind.value}: {SHARDING_UNSUPPORTED}"])
        return self.accelerator.prepare(model)

    def setup_optimizer(self) -> None:
        """The optimizer through ``accelerator.prepare``; Accelerate's grad scaler."""
        optimizer = build_optimizer(self.optimizer_factory, self.model, self.args)
        self.optimizer = self.accelerator.prepare(optimizer)
        self.scaler = self.accelerator.scaler

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

    # ------------------------------------------------------------------ one step
    # The shared forward_backward, with the accelerator's no_sync / autocast / backward.
    def no_sync(self, last: bool) -> AbstractContextManager:
        """Gradients are synchronised only on a window's last micro-batch."""
        return nullcontext() if last else self.accelerator.no_sync(self.wrapped_model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)  # scales for fp16; divides by nothing (see _accelerated)

    def clip_gradients(self) -> torch.Tensor:
        """Unscale (fp16) and clip through the accelerator; the norm before clipping."""
        max_norm = self.args.max_grad_norm or math.inf  # inf: measure only (clip factor 1)
        norm = self.accelerator.clip_grad_norm_(self.wrapped_model.parameters(), max_norm)
        if norm is None:  # DeepSpeed clips inside its step
            return torch.tensor(float("nan"))
        return norm

    def optimizer_step(self) -> None:
        self.optimizer.step()  # Accelerate's optimizer steps and updates its grad scaler

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def autocast(self) -> AbstractContextManager:
        return self.accelerator.autocast() if self.accelerator is not None else nullcontext()

    # ------------------------------------------------------------------ checkpoints
    def model_component(self) -> Component:
        """The weights as ``accelerator.get_state_dict`` gathers them (a LoRA model: its
        adapter, as the plain trainer saves it)."""
        accel, model = self.accelerator, self.model
        if is_peft_model(model):
            return super().model_component()
        weights = ModelWeights(model, self.tokenizer, state_fn=lambda: accel.get_state_dict(model))
        return replace(super().model_component(), obj=weights)

    def optimizer_component(self) -> Component:
        """The state of the optimizer inside Accelerate's wrapper."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return replace(super().optimizer_component(), obj=OptimizerState(self.model, inner))

    def release_wrappers(self) -> None:
        if self.accelerator is not None:
            self.accelerator.free_memory()
        super().release_wrappers()
