"""A batch size that finds itself: Hugging Face's ``auto_find_batch_size``, with the training
kept the same.

HF's Trainer restarts its loop with half the batch after an out-of-memory error, which changes
the global batch and so the run. forge keeps what a step is: the loader still yields
``per_device_train_batch_size`` rows per micro-batch, and after an out-of-memory error each of
those batches is split into pieces of at most half as many rows, run one after the other with
their gradients accumulated. A piece is collated from its share of the batch's items (the loader
keeps them: ``forge.data.collator.KeepItems``), as a batch of its size is, so padded text gets the
piece's own width and dropout the smaller batch's masks; a batch whose rows are not its items
one for one (packing) has its tensors cut instead. The step's samples, their order, the loss normalisation over the
window (each piece's per-batch mean loss counts by its share of the rows; a loss normalised by
``num_items_in_batch`` is already the window's) and so the gradient are those of the step as
configured: the loss curve and the checkpoints do not depend on which size fitted. The data
position, the steps per epoch and every checkpoint stay those of the configured batch.

What counts as out of memory is ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``,
which the CUDA, and other accelerators', caching allocators raise). A failed CPU allocation does
not count: torch raises it as a plain ``RuntimeError`` it shares with other faults, and on Linux
the kernel usually kills the process before torch sees one.

The size that fits is ``TrainerState.train_batch_size`` (HF's field for it): a checkpoint keeps
it, a resume starts from it, and run.json records it. One process only: an error on one rank
leaves the others waiting in a collective of the step (DDP's gradient all-reduce, FSDP's
all-gather) that it never joins, so the ranks cannot agree to shrink without a vote before
every micro-batch's collectives; a job of several processes is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from forge.data.collator import ItemsBatch
from forge.train.args import TrainingArguments, TrainingArgumentsError
from forge.train.callbacks import TrainerState
from forge.train.loop_state import Batch
from forge.train.loss import batch_size_of
from forge.train.topology import Topology

logger = logging.getLogger(__name__)

#: the strategy's forward and backward over a window: (micro-batches, micro-loss) -> (loss, tokens)
ForwardBackward = Callable[[list[Batch], Callable[[Batch], torch.Tensor]], Any]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an accelerator's out-of-memory error (see the module docstring)."""
    kind = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(error, kind)


def auto_batch_problems(args: TrainingArguments, topology: Topology) -> list[str]:
    """Why ``auto_find_batch_size`` cannot run in this job (empty when it can, or is off)."""
    if not args.auto_find_batch_size or topology.world_size == 1:
        return []
    return [
        f"{args.config_key}.auto_find_batch_size needs a job of one process (this one has "
        f"{topology.world_size}): an out-of-memory error on one rank leaves the others waiting "
        "in a collective of the step (the gradient all-reduce, FSDP's all-gather) that it never "
        "joins, so the ranks cannot agree to shrink; set per_device_train_batch_size to what "
        "fits (forge train --dry-run --memory SIZE prints it) and auto_find_batch_size: false"
    ]


def split_batch(batch: Batch, rows: int) -> list[Batch]:
    """``batch`` cut along its first dimension into pieces of at most ``rows`` rows. Tensors and
    lists of the batch's length are cut; any other value (a flag, a scalar) goes to every
    piece."""
    total = batch_size_of(batch)
    if rows >= total:
        return [batch]
    pieces: list[Batch] = [{} for _ in range(0, total, rows)]
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape[0] != total:
                raise ValueError(
                    f"auto_find_batch_size cannot cut the batch: its {key!r} has "
                    f"{value.shape[0]} rows where the batch has {total}; give every tensor of a "
                    "batch its rows first, or set auto_find_batch_size: false"
                )
            parts: Any = value.split(rows)
        elif isinstance(value, (list, tuple)) and len(value) == total:
            parts = [value[start : start + rows] for start in range(0, total, rows)]
        else:
            parts = [value] * len(pieces)
        for piece, part in zip(pieces, parts, strict=True):
            piece[key] = part
    return pieces


def found_batch_record(args: Any, state: TrainerState) -> dict[str, Any]:
    """run.json's record of the micro-batch ``auto_find_batch_size`` runs (empty when off):
    the per-device batch and accumulation the steps run as, and the configured ones."""
    size = state.train_batch_size
    if not getattr(args, "auto_find_batch_size", False) or size is None:
        return {}
    loaded, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "train_batch_size": {
            "per_device": size,
            "gradient_accumulation_steps": accumulation * -(-loaded // size),
            "configured": {"per_device": loaded, "gradient_accumulation_steps": accumulation},
        }
    }


class MicroBatchSize:
    """The rows one forward and backward runs: the loaded batch, or pieces of it once an
    out-of-memory error asked for smaller ones (``auto_find_batch_size``).

    ``state.train_batch_size`` holds the size (None: the loaded batch), so a checkpoint saves
    it and a resume restores it before the first step.
    """

    def __init__(self, args: TrainingArguments, state: TrainerState, topology: Topology) -> None:
        problems = auto_batch_problems(args, topology)
        if problems:
            raise TrainingArgumentsError(problems)
        self.enabled = bool(args.auto_find_batch_size)
        self.loaded = int(args.per_device_train_batch_size)  # rows of one loaded batch
        self.accumulation = int(args.gradient_accumulation_steps)
        self.state = state
        self._is_main = topology.is_main
        #: items -> a batch on the device, as the loader collates (set with the train loader):
        #: a piece of a loaded batch is collated from its share of the batch's items
        self.collate: Callable[[list[Any]], Batch] | None = None

    @property
    def size(self) -> int:
        """Rows per forward and backward now (at most the loaded batch's)."""
        return min(self.state.train_batch_size or self.loaded, self.loaded)

    def start(self, state: TrainerState) -> None:
        """Before the first step of a ``train()`` call, with its state: the size a resume
        restored, else the loaded batch."""
        self.state = state
        if not self.enabled:
            return
        self.state.train_batch_size = self.size
        if self.size < self.loaded:
            self._info(
                "auto_find_batch_size: the checkpoint ran micro-batches of %d rows; "
                "continuing with them (%s)",
                self.size,
                self.describe(),
            )

    def describe(self) -> str:
        """The per-device batch and accumulation the step runs as, for messages."""
        pieces = -(-self.loaded // self.size)  # ceil: the pieces of one loaded batch
        return (
            f"per-device batch {self.size} x accumulation {self.accumulation * pieces}, the "
            f"step of {self.loaded} x {self.accumulation} as configured"
        )

    def run(
        self,
        window: list[Batch],
        loss_of: Callable[..., torch.Tensor],
        forward_backward: ForwardBackward,
        restart: Callable[[], Callable[[], None]],
    ) -> Any:
        """``forward_backward`` over ``window``, each micro-batch's loss from
        ``loss_of(batch, window_size=...)``. With ``auto_find_batch_size``, an out-of-memory
        error halves the micro-batch and redoes the step from its start: ``restart()`` is called
        before the first try and returns what undoes a partial one (its gradients, the model
        metrics it added); the random generators are put back as they were."""
        if not self.enabled:
            micro_loss = _micro_loss(loss_of, {id(b): len(window) for b in window})
            return forward_backward(window, micro_loss)
        undo, generators = restart(), _generator_states()
        while True:
            pieces, divisors = self._pieces(window)
            try:
                return forward_backward(pieces, _micro_loss(loss_of, divisors))
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                failed = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
            # out of the except block: the error's frames, and the activations they hold, are
            # gone before the memory is handed back
            del pieces, divisors
            undo()
            free_cached_memory()
            self._shrink(failed)
            _restore_generators(generators)

    def _pieces(self, window: list[Batch]) -> tuple[list[Batch], dict[int, float]]:
        """The window's batches cut to ``size`` rows, and for each piece what its per-batch
        loss is divided by: the window's length over the piece's share of its batch's rows."""
        pieces, divisors = [], {}
        for batch in window:
            rows = batch_size_of(batch)
            for piece in self._split(batch, rows):
                pieces.append(piece)
                share = batch_size_of(piece) / rows if piece is not batch else 1
                divisors[id(piece)] = len(window) / share
        return pieces, divisors

    def _split(self, batch: Batch, rows: int) -> list[Batch]:
        """``batch`` in pieces of ``size`` rows: each collated from its items as a batch of
        that size is (its own padding width, so dropout draws what the smaller batch's run
        draws), or, for a batch that keeps no items one for one with its rows (a packing
        collator, a loader other than forge's), its tensors cut."""
        kept = isinstance(batch, ItemsBatch) and len(batch.source_items) == rows
        if rows <= self.size or self.collate is None or not kept:
            return split_batch(batch, self.size)
        items, size = batch.source_items, self.size
        return [self.collate(items[start : start + size]) for start in range(0, rows, size)]

    def _shrink(self, failed: str) -> None:
        size = self.size
        if size == 1:
            raise torch.OutOfMemoryError(
                f"out of memory with micro-batches of 1 row ({failed}); auto_find_batch_size "
                "cannot go lower: use a smaller model or sequence length, activation "
                "checkpointing, bf16, or a device with more memory"
            )
        self.state.train_batch_size = (size + 1) // 2
        self._info(
            "auto_find_batch_size: out of memory at step %d with micro-batches of %d rows "
            "(%s); redoing the step with %d: %s",
            self.state.global_step + 1,
            size,
            failed,
            self.size,
            self.describe(),
            level=logging.WARNING,
        )

    def _info(self, message: str, *values: Any, level: int = logging.INFO) -> None:
        if self._is_main:
            logger.log(level, message, *values)


def _micro_loss(
    loss_of: Callable[..., torch.Tensor], divisors: dict[int, float]
) -> Callable[[Batch], torch.Tensor]:
    def micro_loss(batch: Batch) -> torch.Tensor:
        return loss_of(batch, window_size=divisors[id(batch)])

    return micro_loss


def _generator_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """torch's random generators (CPU, and CUDA's once it is in use): a redone step draws what
    the first try drew (dropout)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_generators(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def free_cached_memory() -> None:
    """Hand the failed try's blocks back to the device (CUDA's caching allocator keeps them)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
