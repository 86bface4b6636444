"""What of a LightningModule forge does not run, said before the first step: the hooks a
Lightning ``Trainer.fit`` would call and forge's trainers do not, manual optimization, and the
parts of ``self.trainer`` that have no counterpart (:class:`StandInTrainer`).

A hook the module overrides and the adapter does not run is refused, each with what to do
instead; one listed in the adapter's ``ignore_hooks`` is skipped with a warning, once. Hooks that
``Trainer.fit`` never calls (``test_step``, ``predict_step`` and their ``on_test_*`` /
``on_predict_*`` hooks) are no concern of training.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["LightningAdapterError", "StandInTrainer", "check_module", "lightning_base"]


class LightningAdapterError(RuntimeError):
    """A LightningModule asks for something forge's trainers do not do (a RuntimeError rather
    than an AttributeError, so that a property that meets it does not hide its message)."""


_LOG_IN_STEP = "log with self.log in training_step / validation_step"
_CALLBACK = "or give the trainer a forge TrainerCallback (the config's callbacks block)"

#: hooks ``Trainer.fit`` calls that the adapter does not, and what to do instead
NOT_RUN: dict[str, str] = {
    **dict.fromkeys(
        (
            "on_fit_start",
            "on_fit_end",
            "on_train_start",
            "on_train_end",
            "on_train_epoch_start",
            "on_train_epoch_end",
            "on_train_batch_start",
            "on_train_batch_end",
            "on_validation_start",
            "on_validation_end",
            "on_validation_epoch_start",
            "on_validation_epoch_end",
            "on_validation_batch_start",
            "on_validation_batch_end",
        ),
        f"{_LOG_IN_STEP} (on_epoch=True gives the epoch's mean), {_CALLBACK}",
    ),
    **dict.fromkeys(
        (
            "on_before_backward",
            "on_after_backward",
            "on_before_optimizer_step",
            "on_before_zero_grad",
            "backward",
            "optimizer_step",
            "optimizer_zero_grad",
            "lr_scheduler_step",
        ),
        "the trainer runs the backward and the optimizer step itself; a TrainerCallback's "
        "on_optimizer_step follows each step",
    ),
    "configure_gradient_clipping": "set trainer_args.max_grad_norm (Lightning's gradient_clip_val)",
    **dict.fromkeys(
        ("on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad"),
        "evaluation puts the model in eval mode (model.eval()) and back",
    ),
    **dict.fromkeys(
        ("transfer_batch_to_device", "on_before_batch_transfer", "on_after_batch_transfer"),
        "build the batch in the config's data_collator; the trainer moves its tensors to the "
        "device",
    ),
    **dict.fromkeys(
        ("prepare_data", "train_dataloader", "val_dataloader"),
        "give the data in the config's datasets block (train_dataset, eval_dataset)",
    ),
    **dict.fromkeys(
        ("setup", "configure_model", "configure_sharded_model", "teardown"),
        "build the layers in __init__ (the trainer builds the model, then wraps it)",
    ),
    **dict.fromkeys(
        ("on_save_checkpoint", "on_load_checkpoint"),
        "a forge checkpoint holds the weights and buffers, the optimizer and the schedule; keep "
        "other state in buffers, or in a TrainerCallback with state_dict / load_state_dict",
    ),
    "configure_callbacks": "give forge TrainerCallbacks in the config's callbacks block",
}

_warned: set[tuple[str, str]] = set()  # (class, hook): warned once per process


def lightning_base(module: nn.Module) -> type:
    """Lightning's ``LightningModule`` class when ``module`` is one (from the ``lightning`` or
    the older ``pytorch_lightning`` package, whichever it was built from), else ``nn.Module``
    (a stand-in with the same methods, as the tests use)."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        package = sys.modules.get(name)
        base = getattr(package, "LightningModule", None)
        if isinstance(base, type) and isinstance(module, base):
            return base
    return nn.Module


def overrides(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s class defines hook ``name`` itself (not Lightning's default)."""
    mine = getattr(type(module), name, None)
    return mine is not None and mine is not getattr(lightning_base(module), name, None)


def check_module(module: nn.Module, ignore_hooks: Iterable[str] = ()) -> None:
    """Refuse what the adapter cannot run as Lightning would: manual optimization, no
    ``training_step``, hooks it does not call (unless ``ignore_hooks`` names them: then a
    warning, once)."""
    owner = type(module).__name__
    ignored = list(ignore_hooks)
    unknown = [name for name in ignored if name not in NOT_RUN or not overrides(module, name)]
    if unknown:
        raise LightningAdapterError(
            f"LightningAdapter ignore_hooks names {', '.join(unknown)}, which {owner} does not "
            f"override among the hooks forge does not run ({', '.join(sorted(NOT_RUN))})"
        )
    if not getattr(module, "automatic_optimization", True):
        raise LightningAdapterError(
            f"{owner}.automatic_optimization is False (manual optimization: training_step "
            "calls the optimizers itself); forge's trainers run the backward and the optimizer "
            "step: let training_step return the loss, with automatic optimization"
        )
    if not overrides(module, "training_step"):
        raise LightningAdapterError(
            f"{owner} has no training_step: LightningAdapter trains with it (a module whose "
            "forward returns the loss needs no adapter; forge.train.LossAdapter takes one that "
            "returns it as a bare tensor)"
        )
    refused = [name for name in NOT_RUN if overrides(module, name) and name not in ignored]
    if refused:
        lines = "; ".join(f"{owner}.{name}: {NOT_RUN[name]}" for name in refused)
        raise LightningAdapterError(
            f"LightningAdapter does not run {', '.join(refused)}, which {owner} overrides "
            f"(Lightning's Trainer would call them): {lines}. To train without them, list them "
            f"in the adapter's ignore_hooks: [{', '.join(refused)}]"
        )
    for name in ignored:
        if (owner, name) not in _warned:
            _warned.add((owner, name))
            logger.warning(
                "LightningAdapter does not run %s.%s (ignore_hooks lists it)", owner, name
            )


_OPTIMIZERS = (
    "the trainer steps the optimizer configure_optimizers returns itself (automatic "
    "optimization), and logs its learning rate as learning_rate; training_step returns the "
    "loss and touches no optimizer"
)
#: what a LightningModule method reads of its trainer -> (the call the user wrote, the reason)
_ASKED_THROUGH = {
    "strategy": ("self.optimizers()", _OPTIMIZERS),
    "optimizers": ("self.optimizers(use_pl_optimizer=False)", _OPTIMIZERS),
    "lr_scheduler_configs": (
        "self.lr_schedulers()",
        "the trainer steps the schedulers configure_optimizers returns when Lightning's would "
        "(their interval and frequency), and logs the learning rate as learning_rate",
    ),
}


class StandInTrainer:
    """What a LightningModule's ``self.trainer`` (and ``self.current_epoch``,
    ``self.global_step``, ``self.global_rank`` ...) reads under forge: the run's counters, its
    length and its ranks. Anything else of Lightning's Trainer raises
    :class:`LightningAdapterError` naming it; ``logger`` is None and ``loggers`` empty, as a
    Lightning Trainer without a logger has (forge's logs are what ``self.log`` records)."""

    logger = None
    loggers: list[Any] = []
    progress_bar_callback = None
    sanity_checking = False
    barebones = False

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._plan: Any = None  # forge.train.model_parts.TrainingPlan, once train() starts
        self._state: Any = None  # the trainer's TrainerState, once train() starts
        self._epoch = lambda: 0
        self.training = True

    def _attach(self, plan: Any = None, state: Any = None, epoch: Any = None) -> None:
        self._plan = plan if plan is not None else self._plan
        self._state = state if state is not None else self._state
        self._epoch = epoch if epoch is not None else self._epoch

    @property
    def validating(self) -> bool:
        return not self.training

    @property
    def current_epoch(self) -> int:
        return self._epoch()

    @property
    def global_step(self) -> int:
        return self._state.global_step if self._state is not None else 0

    def _topology(self, name: str, default: int) -> int:
        return getattr(self._plan.topology, name) if self._plan is not None else default

    @property
    def global_rank(self) -> int:
        return self._topology("rank", 0)

    @property
    def local_rank(self) -> int:
        return self._topology("local_rank", 0)

    @property
    def world_size(self) -> int:
        return self._topology("world_size", 1)

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def _planned(self, name: str) -> int:
        if self._plan is None:
            raise LightningAdapterError(
                f"self.trainer.{name} is known once forge's trainer starts training"
            )
        return getattr(self._plan, name)

    @property
    def max_steps(self) -> int:
        return self._planned("max_steps")

    @property
    def estimated_stepping_batches(self) -> int:
        return self._planned("max_steps")

    @property
    def max_epochs(self) -> int:
        return self._planned("num_epochs")

    @property
    def num_training_batches(self) -> int:
        return self._planned("batches_per_epoch")

    @property
    def accumulate_grad_batches(self) -> int:
        return self._planned("gradient_accumulation_steps")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _ASKED_THROUGH:  # LightningModule methods read these of their trainer
            called, gives = _ASKED_THROUGH[name]
            raise LightningAdapterError(
                f"{self._owner} calls {called}, which forge's LightningAdapter does not give: "
                f"{gives}"
            )
        raise LightningAdapterError(
            f"{self._owner} reads self.trainer.{name}, which forge's LightningAdapter does not "
            "give: its stand-in trainer has current_epoch, global_step, global_rank, "
            "local_rank, world_size, is_global_zero, max_steps, max_epochs, "
            "estimated_stepping_batches, num_training_batches, accumulate_grad_batches, "
            "training, validating, logger (None); read the trainer's arguments from the config "
            "instead"
        )
