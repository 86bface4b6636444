"""A LightningModule trained by forge's trainers as Lightning's Trainer trains it.

:class:`LightningAdapter` is the model the trainer calls: in train mode its forward runs the
module's ``training_step(batch, batch_idx)`` and returns the loss with what ``self.log``
recorded, in eval mode ``validation_step``; ``configure_optimizers`` gives the optimizer and
schedule (forge/train/model_parts.py says how a model offers them); hooks it does not run are
refused before the first step (forge/train/lightning/hooks.py). The module is kept as
``self.module``, so checkpoints hold its own ``state_dict`` (a LightningModule loads
``model.safetensors`` as it is).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from forge.checkpoint import Component, Scope
from forge.train.callbacks import TrainerCallback
from forge.train.lightning.hooks import (
    LightningAdapterError,
    StandInTrainer,
    check_module,
    lightning_base,
    overrides,
)
from forge.train.lightning.logged import (
    TRAINING,
    VALIDATION,
    Logged,
    LogRecorder,
    TrainingProgress,
)
from forge.train.lightning.optimizers import LightningSchedule, ScheduleConfig, configured
from forge.train.loss import batch_size_of
from forge.train.model_parts import ModelParts, TrainingPlan

__all__ = ["LightningAdapter"]

BATCH_TYPES = ("dict", "list")


class LightningAdapter(nn.Module):
    """A LightningModule's ``training_step`` / ``validation_step`` as the forward forge's
    trainers call, with its ``configure_optimizers`` and ``self.log``.

    ``module`` is a LightningModule (or a zero-argument callable that builds one: a
    ``!partial``, called when the trainer builds the model, after seeding). ``batch_type``:
    what the steps get as ``batch``: ``dict`` (the batch as the collator made it) or ``list``
    (its values in order: the ``[x, y]`` torch's default collation makes of ``(x, y)`` items,
    whose parts ``forge.data.TupleCollator`` names). ``ignore_hooks``: hooks the module
    overrides that forge does not run, to train without them (a warning, instead of the
    refusal). In a config::

        model: &model !partial:forge.train:LightningAdapter
            module: !partial:./model.py:Classifier {lr: 0.1}
            batch_type: list
    """

    #: the steps take the batch whole: remove_unused_columns keeps every column
    takes_whole_batch = True

    def __init__(
        self,
        module: nn.Module | Callable[[], nn.Module],
        batch_type: str = "dict",
        ignore_hooks: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if batch_type not in BATCH_TYPES:
            raise ValueError(
                f"LightningAdapter batch_type must be one of {', '.join(BATCH_TYPES)} "
                f"(got {batch_type!r})"
            )
        if not isinstance(module, nn.Module):
            if not callable(module):
                raise TypeError(
                    "LightningAdapter module must be a LightningModule or a callable that builds "
                    f"one (got {type(module).__name__})"
                )
            module = module()
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"LightningAdapter module built a {type(module).__name__}, not a module"
                )
        owner = type(module).__name__
        check_module(module, ignore_hooks)
        self.module = module
        self.batch_type = batch_type
        self.progress = TrainingProgress()
        self._owner = owner
        self._eval_batches = 0  # validation batches since the model went into eval mode
        self._logged = LogRecorder(owner)
        self._trainer = StandInTrainer(owner)
        self._trainer._attach(epoch=lambda: self.progress.epoch)
        self._takes_index = {
            name: _takes_batch_idx(getattr(module, name), f"{owner}.{name}")
            for name in (TRAINING, VALIDATION)
            if overrides(module, name)
        }
        self._attach(module)

    def _attach(self, module: nn.Module) -> None:
        """Give the module (and the LightningModules inside it) the recorder's ``log`` and
        ``log_dict`` and the stand-in ``trainer``, on the instances."""
        lightning = lightning_base(module)
        for part in module.modules():
            if part is not module and (lightning is nn.Module or not isinstance(part, lightning)):
                continue
            part.__dict__["log"] = self._logged.log
            part.__dict__["log_dict"] = self._logged.log_dict
            if lightning is nn.Module:
                part.__dict__["trainer"] = self._trainer
            else:
                part._trainer = self._trainer  # what Lightning's own properties read

    # ------------------------------------------------------------------ the steps
    def forward(self, **batch: Any) -> dict[str, Any]:
        given = list(batch.values()) if self.batch_type == "list" else batch
        if self.training:
            return self._training_step(batch, given)
        return self._validation_step(batch, given)

    def _training_step(self, batch: dict[str, Any], given: Any) -> dict[str, Any]:
        progress = self.progress
        index = progress.next_batch()
        with self._logged.recording(TRAINING) as records:
            result = self._call(TRAINING, given, index)
        outputs: dict[str, Any] = {"loss": self._training_loss(result)}
        size = batch_size_of(batch)
        for record in records:
            if record.on_step:
                outputs[record.step_name] = record.value
            if record.on_epoch:
                weight = record.batch_size or size
                mean = progress.add(record.epoch_name, record.value, weight)
                # returned once, by the epoch's last batch: the mean the window logs is this
                if progress.epoch_ended:
                    outputs[record.epoch_name] = mean
        return outputs

    def _validation_step(self, batch: dict[str, Any], given: Any) -> dict[str, Any]:
        if VALIDATION not in self._takes_index:
            raise LightningAdapterError(
                f"{self._owner} has no validation_step, which forge's evaluation runs; define "
                "it, or set trainer_args.eval_strategy: 'no' and give no eval_dataset"
            )
        index, self._eval_batches = self._eval_batches, self._eval_batches + 1
        with self._logged.recording(VALIDATION) as records:
            result = self._call(VALIDATION, given, index)
        outputs: dict[str, Any] = {}
        loss = _returned_loss(result)
        if loss is not None:
            outputs["loss"] = loss
        size = batch_size_of(batch)
        for record in records:
            self._check_eval_record(record, size)
            outputs[record.epoch_name if record.on_epoch else record.name] = record.value
        return outputs

    def _call(self, name: str, batch: Any, index: int) -> Any:
        step = getattr(self.module, name)
        return step(batch, index) if self._takes_index[name] else step(batch)

    def _training_loss(self, result: Any) -> torch.Tensor:
        loss = _returned_loss(result)
        if loss is None:
            got = "None" if result is None else f"a {type(result).__name__} without 'loss'"
            raise LightningAdapterError(
                f"{self._owner}.training_step returned {got}; Lightning skips such a batch, "
                "forge's trainers do not (every rank must step together): return the loss "
                "(a tensor, or a dict with 'loss')"
            )
        return loss

    def _check_eval_record(self, record: Logged, size: int) -> None:
        recorder = self._logged
        if record.on_step:
            recorder.warn_once(
                f"eval-step:{record.name}",
                "%s: self.log(%r, on_step=True) in validation_step: forge logs the mean over "
                "the evaluation's batches (as eval_%s), not each batch's value",
                self._owner,
                record.name,
                record.epoch_name if record.on_epoch else record.name,
            )
        if record.batch_size is not None and record.batch_size != size:
            recorder.warn_once(
                f"eval-size:{record.name}",
                "%s: self.log(%r, batch_size=%d) in validation_step: forge weighs evaluation "
                "values by the batch's items (%d here), as it does the loss",
                self._owner,
                record.name,
                record.batch_size,
                size,
            )

    # ------------------------------------------------------------------ modes and devices
    def train(self, mode: bool = True) -> LightningAdapter:
        if not mode and self.training:
            self._eval_batches = 0  # an evaluation starts: validation_step's batch_idx from 0
        self._trainer.training = mode
        return super().train(mode)

    def to(self, *args: Any, **kwargs: Any) -> LightningAdapter:
        self.module.to(*args, **kwargs)  # a LightningModule's own .to() records its device
        return super().to(*args, **kwargs)

    # ------------------------------------------------------------------ what it brings
    def trainer_parts(self, plan: TrainingPlan) -> ModelParts:
        """The optimizer and schedule of ``configure_optimizers`` (the trainer's defaults
        without one) and the callback that keeps the epochs (forge/train/model_parts.py)."""
        if plan.topology.num_stages > 1:
            raise LightningAdapterError(
                f"LightningAdapter runs {self._owner}.training_step whole; the pipeline "
                "trainer splits a model's layers into stages: use Trainer or AccelTrainer"
            )
        progress = self.progress
        progress.restart_epoch(0)  # a resume restores it once the checkpoint loads
        progress.batches_per_epoch = plan.batches_per_epoch
        self._trainer._attach(plan=plan)
        callbacks = [LightningCallback(self)]
        source = f"{self._owner}.configure_optimizers"
        if not overrides(self.module, "configure_optimizers"):
            return ModelParts(callbacks=callbacks, source=source)
        built: list[tuple[Any, list[ScheduleConfig]]] = []

        def optimizer(parameters: list[nn.Parameter]) -> Any:
            built[:] = [configured(self.module.configure_optimizers(), self._owner)]
            return built[0][0]

        def lr_scheduler(optimizer: Any, num_training_steps: int) -> LightningSchedule:
            configured_optimizer, configs = built[0]
            return LightningSchedule(configured_optimizer, configs, progress)

        return ModelParts(optimizer, lr_scheduler, callbacks, source)


class LightningCallback(TrainerCallback):
    """The trainer side of a :class:`LightningAdapter`: its epoch progress is a checkpoint
    component of each rank, and a step that ends an epoch logs its ``on_epoch`` means (before a
    save at that step: a checkpoint's log window never holds them, so a resumed run logs what
    the straight one does)."""

    def __init__(self, adapter: LightningAdapter) -> None:
        self.adapter = adapter

    def on_register(self, args, state, control, register, **kwargs):
        progress = self.adapter.progress

        def restart(description: str) -> None:  # another data-parallel size: the epoch restarts
            progress.restart_epoch(int(state.epoch))

        register(Component("lightning", progress, Scope.RANK, on_reshape=restart))

    def on_train_begin(self, args, state, control, **kwargs):
        self.adapter._trainer._attach(state=state)

    def on_step_end(self, args, state, control, **kwargs):
        progress = self.adapter.progress
        if progress.epoch_ended and progress.sums and args.logging_strategy == "steps":
            control.should_log = True  # ("epoch" logs there anyway)


def _returned_loss(result: Any) -> torch.Tensor | None:
    """The loss a step returned: a tensor, or a dict's ``loss``; None otherwise."""
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
        return result["loss"]
    return None


def _takes_batch_idx(step: Callable[..., Any], label: str) -> bool:
    """Whether a step takes ``batch_idx`` (Lightning passes it only then)."""
    parameters = list(inspect.signature(step).parameters.values())
    if any(p.name == "dataloader_iter" for p in parameters):
        raise LightningAdapterError(
            f"{label} takes dataloader_iter; forge gives a step one batch: take (batch, batch_idx)"
        )
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (
        any(p.name == "batch_idx" for p in parameters)
        or len(positional) >= 2
        or any(p.kind is p.VAR_POSITIONAL for p in parameters)
    )
