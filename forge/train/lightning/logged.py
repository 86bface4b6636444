"""``self.log`` under forge: what a LightningModule's steps record, with Lightning's meanings.

In ``training_step`` a value is by default logged ``on_step`` (forge's log line reports its mean
over the steps since the last log, as it does the loss), and with ``on_epoch=True`` also averaged
over the epoch (weighted by each batch's size, as Lightning does) and logged when the epoch ends;
with both, the two are named ``NAME_step`` and ``NAME_epoch``, as Lightning names them. In
``validation_step`` a value is by default ``on_epoch``: averaged over the evaluation, as the
loss is, and reported as ``eval_NAME``. :class:`LogRecorder` takes the calls;
:class:`TrainingProgress` keeps the epoch's position and means, which checkpoints hold.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from forge.train.lightning.hooks import LightningAdapterError

logger = logging.getLogger(__name__)

__all__ = ["LogRecorder", "Logged", "TrainingProgress"]

TRAINING, VALIDATION = "training_step", "validation_step"
#: output names the trainer reads as the loss and the predictions, never as a logged value
RESERVED = ("loss", "logits")
_MEAN = ("mean", "avg")


@dataclass(frozen=True)
class Logged:
    """One ``self.log`` call: a 0-d floating tensor (detached) and where it is logged."""

    name: str
    value: torch.Tensor
    on_step: bool
    on_epoch: bool
    batch_size: int | None

    @property
    def epoch_name(self) -> str:
        return f"{self.name}_epoch" if self.on_step else self.name

    @property
    def step_name(self) -> str:
        return f"{self.name}_step" if self.on_epoch else self.name


class LogRecorder:
    """Stands in for a LightningModule's ``log`` and ``log_dict`` (set on the instance, so no
    class is patched): records what one ``training_step`` / ``validation_step`` call logs."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.stage: str | None = None
        self.records: list[Logged] = []
        self._warned: set[str] = set()

    @contextmanager
    def recording(self, stage: str) -> Iterator[list[Logged]]:
        """Record the ``self.log`` calls of one ``stage`` call (``training_step`` or
        ``validation_step``)."""
        self.stage, self.records = stage, []
        try:
            yield self.records
        finally:
            self.stage = None

    def warn_once(self, key: str, message: str, *values: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *values)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Lightning's ``self.log``; ``prog_bar`` and ``logger`` choose nothing under forge, which
        shows every logged value in its log line, metrics.jsonl and TensorBoard alike."""
        stage = self.stage
        call = f"{self.owner}: self.log({name!r}, ...)"
        if stage is None:
            raise LightningAdapterError(
                f"{call} outside training_step and validation_step: forge's LightningAdapter "
                "runs only those two steps of the module; log there"
            )
        training = stage == TRAINING
        on_step = training if on_step is None else bool(on_step)
        on_epoch = (not training) if on_epoch is None else bool(on_epoch)
        if not _is_mean(reduce_fx):
            raise LightningAdapterError(
                f"{call} with reduce_fx={reduce_fx!r}: forge averages logged values "
                "(reduce_fx='mean'); log the value to be averaged"
            )
        if name in RESERVED:
            self.warn_once(
                f"reserved:{name}",
                "%s in %s is not logged under that name: forge logs the loss the step returns "
                "as 'loss' itself; log it under another name (e.g. 'train_loss')",
                call,
                stage,
            )
            return
        if not on_step and not on_epoch:
            self.warn_once(
                f"nowhere:{name}",
                "%s with on_step=False and on_epoch=False is logged nowhere (Lightning only "
                "keeps it for its callbacks)",
                call,
            )
            return
        if sync_dist and training:
            self.warn_once(
                f"sync:{name}",
                "%s with sync_dist=True: forge logs rank 0's training values, not their mean "
                "over the ranks (evaluation values are averaged over every rank's batches)",
                call,
            )
        self.records.append(Logged(name, _scalar(value, call), on_step, on_epoch, batch_size))

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        """``self.log`` for each item."""
        if not isinstance(dictionary, Mapping):
            raise LightningAdapterError(
                f"{self.owner}: self.log_dict takes a dict of name to value under forge "
                f"(got {type(dictionary).__name__})"
            )
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)


def _is_mean(reduce_fx: Any) -> bool:
    return (isinstance(reduce_fx, str) and reduce_fx.lower() in _MEAN) or reduce_fx is torch.mean


def _scalar(value: Any, call: str) -> torch.Tensor:
    """``value`` as a detached 0-d floating tensor (float32 at least, as Lightning keeps it)."""
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        return torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        kind = type(value).__name__
        raise LightningAdapterError(
            f"{call} with a {kind}: forge logs numbers and one-element tensors (a torchmetrics "
            "metric: log the value it computes for the batch, e.g. metric(preds, target))"
        )
    if value.numel() != 1:
        raise LightningAdapterError(
            f"{call} with a tensor of shape {tuple(value.shape)}: log one value (e.g. .mean())"
        )
    value = value.detach().reshape(())
    return value if value.dtype in (torch.float32, torch.float64) else value.float()


class TrainingProgress:
    """This rank's place in the training epochs, as the LightningModule sees it (``batch_idx``,
    ``current_epoch``), and the epoch's weighted sums of its ``on_epoch`` values: the adapter's
    checkpoint state (rank-scoped: each rank sees its own batches).

    ``batches_per_epoch`` comes from the trainer when ``train()`` starts (``TrainingPlan``);
    before that (a check, an evaluation) epochs are not counted.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.batches = 0  # micro-batches of the epoch taken so far
        self.batches_per_epoch = 0
        self.sums: dict[str, torch.Tensor] = {}  # value x batch size, summed (float64)
        self.weights: dict[str, float] = {}  # the batch sizes summed

    def next_batch(self) -> int:
        """The epoch-local index of the micro-batch about to run (a new epoch starts at the
        first batch after the last one's step)."""
        if self.epoch_ended:
            self.epoch, self.batches = self.epoch + 1, 0
            self.sums, self.weights = {}, {}
        self.batches += 1
        return self.batches - 1

    @property
    def epoch_ended(self) -> bool:
        """The epoch's last micro-batch has run."""
        return bool(self.batches_per_epoch) and self.batches >= self.batches_per_epoch

    def add(self, name: str, value: torch.Tensor, weight: int) -> torch.Tensor:
        """Add one batch's ``value`` of ``name``; its epoch mean so far (on the device)."""
        value = value.double() * weight
        held = self.sums.get(name)
        self.sums[name] = value if held is None else held + value
        self.weights[name] = self.weights.get(name, 0.0) + weight
        return self.sums[name] / self.weights[name]

    def restart_epoch(self, epoch: int) -> None:
        """At the first batch of ``epoch``, nothing averaged yet (a resume on another number of
        ranks, whose data position restarts the epoch)."""
        self.epoch, self.batches, self.sums, self.weights = epoch, 0, {}, {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches": self.batches,
            "sums": {name: float(total) for name, total in self.sums.items()},  # float64: exact
            "weights": dict(self.weights),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
        # 0-d host tensors: added to the next batch's values wherever those are
        self.sums = {
            name: torch.tensor(total, dtype=torch.float64) for name, total in state["sums"].items()
        }
        self.weights = {name: float(weight) for name, weight in state["weights"].items()}
