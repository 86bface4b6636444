"""The parallelism strategy protocol, and its one-process implementation.

A trainer is the shared loop (forge/train/loop.py) composed with one strategy: how the
processes of a job share the work. The strategy is the last step of the model-transform stage
(``parallelize``), how one optimizer step's micro-batches run (``forward_backward``, with
``no_sync``, ``autocast`` and ``backward``), how gradients are clipped, the optimizer stepped
and numbers summed over the ranks, how an evaluation batch goes forward, and how the weights
and optimizer state are saved (``model_component`` / ``optimizer_component``). The loop names
no strategy; each lives in a file of its own:

- ``ParallelStrategy`` (here): one process, no wrapper;
- ``ddp.DataParallel``: DistributedDataParallel over the ranks;
- ``fsdp.FullyShard``: FSDP2, every parameter sharded over the ranks;
- ``accelerate.Accelerate``: Hugging Face Accelerate does the device work;
- ``pipeline.Pipeline``: the model split into stages, one per process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from forge.checkpoint import Component, load_model_weights
from forge.checkpoint.components import model_component, optimizer_component
from forge.train import dist
from forge.train.args import TrainingArguments
from forge.train.loop_state import Batch, count_tokens
from forge.train.topology import Topology

logger = logging.getLogger(__name__)

#: computes one micro-batch's share of the step's loss (forge/train/loss.py)
MicroLoss = Callable[[Batch], torch.Tensor]


class ParallelStrategy:
    """One process: the model as it is, gradients as they are. Every strategy subclasses it
    and changes what its parallelism changes.

    ``args``, ``topology`` and ``device`` are the trainer's. The strategy keeps what its
    ``parallelize`` built (``wrapped``) and the grad scaler ``prepare_optimizer`` made.
    """

    #: constructor arguments of the trainer this strategy cannot honour, with the reason
    unsupported_arguments: ClassVar[dict[str, str]] = {}
    #: whether ``forward_eval`` gives the model's outputs (predictions for compute_metrics)
    gives_eval_outputs: ClassVar[bool] = True
    #: whether a forward is collective (every rank must run as many): generation runs in step
    collective_forward: ClassVar[bool] = False
    #: whether the strategy computes the loss itself (the trainer's compute_loss is not called)
    computes_loss: ClassVar[bool] = False

    def __init__(self, args: TrainingArguments, topology: Topology, device: torch.device) -> None:
        self.args = args
        self.topology = topology
        self.device = device
        self.wrapped: nn.Module | None = None  # what the training step calls
        self.scaler: torch.amp.GradScaler | None = None

    def info(self, message: str, *values: Any) -> None:
        """Log on rank 0 only."""
        if self.topology.is_main:
            logger.info(message, *values)

    # ------------------------------------------------------------------ the job
    def process_group(self) -> AbstractContextManager:
        """The process group of a multi-process job: created here if none exists (gloo on
        CPU, nccl on CUDA, or ``ddp_backend``) and destroyed at the end. Re-entered (an
        evaluation inside ``train()``), it changes nothing."""
        args = self.args
        return dist.process_group(self.topology, self.device, args.ddp_backend, args.ddp_timeout)

    def per_rank_batch_size(self, field: str) -> int:
        """The batch one rank loads, from the ``args`` field that sets it."""
        return getattr(self.args, field)

    # ------------------------------------------------------------------ the model-transform stage
    def build_model(
        self, given: nn.Module | None, model_init: Callable[[], nn.Module]
    ) -> nn.Module:
        """This rank's model: the module the trainer was given, or ``model_init()``."""
        return given if given is not None else model_init()

    def activation_checkpointing_scope(self) -> dict[str, Any]:
        """Where activation checkpointing finds the blocks (keywords of
        ``apply_activation_checkpointing``): the whole model."""
        return {}

    def parallelize(self, model: nn.Module, compiled: nn.Module | None) -> nn.Module:
        """The transform stage's last step: what the training step calls. ``model`` is the
        module checkpoints hold, ``compiled`` its ``torch.compile`` when that is on."""
        self.wrapped = model if compiled is None else compiled
        return self.wrapped

    def prepare_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer the loop steps; a grad scaler for fp16."""
        self.scaler = torch.amp.GradScaler(self.device.type) if self.args.fp16 else None
        return optimizer

    def release(self) -> None:
        """Drop what ``parallelize`` built (at the end of ``train()``)."""
        self.wrapped = None

    # ------------------------------------------------------------------ one optimizer step
    def forward_backward(
        self, window: list[Batch], micro_loss: MicroLoss
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over one optimizer step's micro-batches (on the device);
        (summed loss share, tokens) on this rank. Gradients sync on the last micro-batch."""
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.long, device=self.device)
        for index, batch in enumerate(window):
            tokens += count_tokens(batch)
            with self.no_sync(last=index == len(window) - 1):
                with self.autocast():
                    loss = micro_loss(batch)
                self.backward(loss)
            loss_sum += loss.detach().float()
        return loss_sum, tokens

    def no_sync(self, last: bool) -> AbstractContextManager:
        """Skip gradient synchronisation on all but the last micro-batch."""
        return nullcontext()

    def autocast(self) -> AbstractContextManager:
        """bf16 / fp16 autocast for the forward pass when requested."""
        args = self.args
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        return torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_gradients(self, model: nn.Module, optimizer: Optimizer) -> torch.Tensor:
        """The total gradient norm before clipping; clips to ``max_grad_norm`` when set."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.args.max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, grad_norm)
        return grad_norm

    def optimizer_step(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def inner_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The torch optimizer itself (inside whatever wraps it)."""
        return optimizer

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (every rank gets the result)."""
        return dist.all_reduce(tensor)

    def agree_max(self, value: float) -> float:
        """The largest ``value`` over the ranks (a host sync)."""
        if not self.topology.distributed:
            return value
        return dist.all_reduce(torch.tensor([float(value)], device=self.device), "max").item()

    # ------------------------------------------------------------------ evaluation
    def eval_forwards(self, count: int) -> int:
        """How many evaluation forwards this rank runs when it has ``count`` batches."""
        return count

    def forward_eval(
        self, batch: Batch, forward: Callable[[], tuple[torch.Tensor | None, Any]]
    ) -> tuple[torch.Tensor | None, Any]:
        """One evaluation batch's (mean loss or None, outputs): ``forward()``, the trainer's
        (its ``compute_loss``), under autocast."""
        with self.autocast():
            return forward()

    # ------------------------------------------------------------------ checkpoints
    def model_component(self, model: nn.Module, tokenizer: Any, adapter_base: Any) -> Component:
        """How the weights are saved: the whole model, or a LoRA model's adapter."""
        return model_component(model, tokenizer, adapter_base=adapter_base)

    def optimizer_component(self, model: nn.Module, optimizer: Optimizer) -> Component:
        """The optimizer's state, keyed by parameter name."""
        return optimizer_component(model, self.inner_optimizer(optimizer), **self.optimizer_flags())

    def optimizer_flags(self) -> dict[str, Any]:
        """Whether the optimizer's state is saved and restored, and the fix when it cannot be."""
        args = self.args
        return {
            "save": args.save_optimizer_state,
            "restore": args.restore_optimizer_state,
            "fix": f"set {args.config_key}.restore_optimizer_state: false to start it fresh",
        }

    def load_weights(self, model: nn.Module, checkpoint: Path) -> None:
        """Load a checkpoint's weights into this rank's model."""
        load_model_weights(model, checkpoint, strict=True)
