"""``configure_optimizers`` under forge: the one optimizer it returns, and its schedulers stepped
as Lightning's Trainer steps them.

Every form Lightning reads is read: an optimizer; a list of one; ``([optimizer], [schedulers])``;
``{"optimizer": ..., "lr_scheduler": ...}`` (or a list of one such dict); each scheduler bare
or as a dict ``{"scheduler": ..., "interval": "step" | "epoch", "frequency": n, "name": ...}``
(Lightning's defaults: ``interval: epoch``, ``frequency: 1``). forge's loop steps its schedule
once per optimizer step; :class:`LightningSchedule` steps a ``step`` scheduler when the number of
micro-batches of the epoch so far is a multiple of its frequency, an ``epoch`` one after the
last step of each epoch whose number (from 1) is, as Lightning does. Several optimizers (which
Lightning runs only with manual optimization) and metric-driven schedulers are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forge.train.lightning.hooks import LightningAdapterError
from forge.train.lightning.logged import TrainingProgress

__all__ = ["LightningSchedule", "ScheduleConfig", "configured"]

_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "name", "monitor", "strict")


@dataclass(frozen=True)
class ScheduleConfig:
    """One scheduler of ``configure_optimizers`` and when it steps."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1


def _is_optimizer(value: Any) -> bool:
    return all(hasattr(value, name) for name in ("step", "zero_grad", "param_groups"))


def configured(result: Any, owner: str) -> tuple[Any, list[ScheduleConfig]]:
    """The optimizer and the schedulers ``configure_optimizers`` returned (``owner`` names the
    method in messages)."""
    where = f"{owner}.configure_optimizers"
    monitor = None
    if _is_optimizer(result):
        optimizers, schedulers = [result], []
    elif (
        isinstance(result, (list, tuple))
        and len(result) == 2
        and isinstance(result[0], (list, tuple))
        and all(_is_optimizer(o) for o in result[0])
    ):
        optimizers = list(result[0])
        schedulers = list(result[1]) if isinstance(result[1], (list, tuple)) else [result[1]]
    elif isinstance(result, dict):
        optimizers, schedulers, monitor = _from_dict(result, where)
    elif isinstance(result, (list, tuple)) and result and all(isinstance(d, dict) for d in result):
        found = [_from_dict(d, where) for d in result]
        optimizers = [o for opts, _, _ in found for o in opts]
        schedulers = [s for _, scheds, _ in found for s in scheds]
    elif isinstance(result, (list, tuple)) and result and all(_is_optimizer(o) for o in result):
        optimizers, schedulers = list(result), []
    elif result is None:
        raise LightningAdapterError(
            f"{where} returned None (Lightning would train without an optimizer); return the "
            "optimizer, or remove configure_optimizers and let the trainer build AdamW from "
            "trainer_args"
        )
    else:
        raise LightningAdapterError(
            f"{where} returned a {type(result).__name__}, which is none of the forms Lightning "
            "reads: an optimizer, [optimizer], ([optimizer], [schedulers]) or "
            "{'optimizer': ..., 'lr_scheduler': ...}"
        )
    if len(optimizers) != 1:
        raise LightningAdapterError(
            f"{where} returned {len(optimizers)} optimizers; Lightning runs several only with "
            "manual optimization, and forge's trainers step one: return one optimizer (one "
            "with several parameter groups, if they need different settings)"
        )
    optimizer = optimizers[0]
    return optimizer, [_schedule(s, optimizer, monitor, where) for s in schedulers]


def _from_dict(config: dict[str, Any], where: str) -> tuple[list[Any], list[Any], Any]:
    if "optimizer" not in config:
        raise LightningAdapterError(
            f"{where} returned a dict without 'optimizer' (keys: {', '.join(map(str, config))})"
        )
    extra = sorted(set(config) - {"optimizer", "lr_scheduler", "monitor"})
    if extra:
        raise LightningAdapterError(
            f"{where} returned a dict with keys Lightning does not read: {', '.join(extra)}"
        )
    schedulers = [config["lr_scheduler"]] if config.get("lr_scheduler") is not None else []
    return [config["optimizer"]], schedulers, config.get("monitor")


def _schedule(spec: Any, optimizer: Any, monitor: Any, where: str) -> ScheduleConfig:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    config = dict(spec) if isinstance(spec, dict) else {"scheduler": spec}
    extra = sorted(set(config) - set(_SCHEDULER_KEYS))
    if extra or "scheduler" not in config:
        problem = f"keys Lightning does not read: {', '.join(extra)}" if extra else "no 'scheduler'"
        raise LightningAdapterError(
            f"{where} returned a scheduler dict with {problem} (it reads "
            f"{', '.join(_SCHEDULER_KEYS)})"
        )
    scheduler = config["scheduler"]
    if isinstance(scheduler, ReduceLROnPlateau):
        metric = config.get("monitor") or monitor
        raise LightningAdapterError(
            f"{where} returned a ReduceLROnPlateau scheduler (monitor: {metric!r}), which steps "
            "on a metric; forge steps such a schedule after each evaluation: set trainer_args "
            "lr_scheduler_type: reduce_lr_on_plateau with metric_for_best_model, and return "
            "the optimizer alone"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise LightningAdapterError(
            f"{where} returned a scheduler of another optimizer than the one it returned"
        )
    interval = config.get("interval", "epoch")
    frequency = config.get("frequency", 1)
    if interval not in ("step", "epoch"):
        raise LightningAdapterError(
            f"{where}: a scheduler's interval must be 'step' or 'epoch' (got {interval!r})"
        )
    if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
        raise LightningAdapterError(
            f"{where}: a scheduler's frequency must be a positive integer (got {frequency!r})"
        )
    return ScheduleConfig(scheduler, interval, frequency)


class LightningSchedule:
    """The schedulers of ``configure_optimizers`` as one schedule the loop steps after each
    optimizer step; each steps when Lightning's Trainer would (see the module docstring),
    reading where the epoch is from the adapter's ``progress``. Without schedulers the learning
    rate stays as the optimizer has it, as under Lightning. Its state (the schedulers') is the
    checkpoint's ``lr_scheduler``."""

    def __init__(
        self, optimizer: Any, configs: list[ScheduleConfig], progress: TrainingProgress
    ) -> None:
        self.optimizer = optimizer
        self.configs = list(configs)
        self.progress = progress

    def step(self) -> None:
        progress = self.progress
        for config in self.configs:
            if config.interval == "step":
                due = progress.batches % config.frequency == 0
            else:
                due = progress.epoch_ended and (progress.epoch + 1) % config.frequency == 0
            if due:
                config.scheduler.step()

    def get_last_lr(self) -> list[float]:
        """The learning rates the next step uses (the optimizer's, whichever scheduler set
        them)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [config.scheduler.state_dict() for config in self.configs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.configs):
            raise ValueError(
                f"the checkpoint holds {len(saved)} schedulers; configure_optimizers returns "
                f"{len(self.configs)}"
            )
        for config, scheduler_state in zip(self.configs, saved, strict=True):
            config.scheduler.load_state_dict(scheduler_state)
