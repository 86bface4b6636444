"""The checks of the arguments that shape a step: output, length and batches, optimizer,
learning-rate schedule (``TrainingArguments.validate`` runs them with the others)."""

from __future__ import annotations

import math
from os import PathLike

from forge.train.args.names import (
    OPTIMIZERS,
    OTHER_HF_OPTIMIZERS,
    SCHEDULERS,
    SCHEDULES_WITH_REQUIRED_KWARGS,
    schedule_keywords,
)
from forge.train.args.values import ValueChecks, as_float, as_int, quoted


class StepChecks(ValueChecks):
    """``_check_*`` methods of ``TrainingArguments`` for how each step trains."""

    def _check_output(self, p: list[str]) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # HF's default
        if isinstance(self.output_dir, PathLike):
            self.output_dir = str(self.output_dir)
        if not isinstance(self.output_dir, str) or not self.output_dir.strip():
            p.append(
                f"{self._key('output_dir')} must be a non-empty path (got {self.output_dir!r}); "
                "set it to the run directory"
            )

    def _check_length(self, p: list[str]) -> None:
        max_steps = as_int(self.max_steps)
        if max_steps is None or max_steps == 0 or max_steps < -1:
            p.append(
                f"{self._key('max_steps')} must be -1 or a positive integer "
                f"(got {self.max_steps!r}); use -1 to train for num_train_epochs"
            )
        else:
            self.max_steps = max_steps
        self._float("num_train_epochs", p, positive=True, fix="e.g. num_train_epochs: 1")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            self._int(name, p, minimum=1)
        self._int("gradient_accumulation_steps", p, minimum=1, fix="use 1 to step every batch")
        self._bool("average_tokens_across_devices", p)

    def _check_optimizer(self, p: list[str]) -> None:
        self._float("learning_rate", p, minimum=0.0)
        self._float("weight_decay", p, minimum=0.0)
        self._float("adam_beta1", p, minimum=0.0, maximum=1.0, open_max=True)
        self._float("adam_beta2", p, minimum=0.0, maximum=1.0, open_max=True)
        self._float("adam_epsilon", p, positive=True)
        if self.max_grad_norm is not None:
            self._float("max_grad_norm", p, minimum=0.0, fix="use 0 or null to disable clipping")
        self._float("label_smoothing_factor", p, minimum=0.0, maximum=1.0, open_max=True)
        self._bool("skip_nonfinite", p)
        optim = self.optim
        if optim in OTHER_HF_OPTIMIZERS:
            p.append(
                f"{self._key('optim')} {optim!r} is not one forge builds (it needs another "
                f"library or its own training loop); use one of {quoted(OPTIMIZERS)}, or pass "
                "the optimizer itself in the config's optimizer block"
            )
            return
        if optim not in OPTIMIZERS:
            self._choice("optim", tuple(OPTIMIZERS), p)
            return
        if self.optim_args is not None:
            self._check_optim_args(p)

    def _check_ema(self, p: list[str]) -> None:
        """The moving average of the weights (forge/train/ema.py): ``ema_decay`` null or 0
        turns it off; ``eval_with_ema`` needs it on."""
        decay = as_float(self.ema_decay)
        if self.ema_decay is not None and decay == 0:
            self.ema_decay = None
        elif self.ema_decay is not None:
            if decay is None or not 0 < decay < 1:
                p.append(
                    f"{self._key('ema_decay')} must be a number in (0, 1) (got "
                    f"{self.ema_decay!r}); e.g. 0.999, or null (or 0) to turn the average off"
                )
            else:
                self.ema_decay = decay
        self._int("ema_warmup_steps", p, minimum=0, fix="0 for no warmup")
        self._int("ema_update_every", p, minimum=1, fix="1 updates after every optimizer step")
        self._bool("eval_with_ema", p)
        if self.eval_with_ema is True and self.ema_decay is None:
            p.append(
                f"{self._key('eval_with_ema')} evaluates with the moving average of the weights, "
                "which is off (ema_decay is null); set ema_decay (e.g. 0.999) or "
                "eval_with_ema: false"
            )

    def _check_optim_args(self, p: list[str]) -> None:
        key, accepted = self._key("optim_args"), OPTIMIZERS[self.optim]
        if not isinstance(self.optim_args, str):
            p.append(f'{key} must be a string such as "momentum=0.9" (got {self.optim_args!r})')
            return
        if not accepted and self.optim_args.strip():
            p.append(
                f"{key} has no effect on optim {self.optim!r} (HF reads none for it); set its "
                "settings through learning_rate, weight_decay and adam_*, or remove optim_args"
            )
            return
        for item in filter(None, self.optim_args.replace(" ", "").split(",")):
            name, equals, value = item.partition("=")
            if not equals or name not in accepted:
                p.append(
                    f"{key}: {item!r} is not KEY=VALUE with KEY one of {list(accepted)} "
                    f"(what {self.optim!r} reads)"
                )
            elif name not in ("nesterov", "centered") and as_float(value) is None:
                p.append(f"{key}: {name} must be a number (got {value!r})")

    def _check_schedule(self, p: list[str]) -> None:
        self._choice("lr_scheduler_type", SCHEDULERS, p)
        self._dict("lr_scheduler_kwargs", p)
        self._check_scheduler_kwargs(p)
        warmup = as_float(self.warmup_steps)
        if warmup is None or not math.isfinite(warmup) or warmup < 0:
            p.append(
                f"{self._key('warmup_steps')} must be a number of steps >= 0, or a fraction of "
                f"the training steps below 1 (got {self.warmup_steps!r})"
            )
        elif warmup >= 1 and not warmup.is_integer():
            p.append(
                f"{self._key('warmup_steps')} must be an integer when it is 1 or more "
                f"(got {self.warmup_steps!r}); below 1 it is a fraction of the training steps"
            )
        else:
            self.warmup_steps = int(warmup) if warmup >= 1 or warmup == 0 else warmup
        self._float("warmup_ratio", p, minimum=0.0, maximum=1.0)
        if isinstance(self.warmup_ratio, float) and self.warmup_ratio > 0 and warmup:
            p.append(
                f"{self._key('warmup_ratio')} and warmup_steps are both set; set one of them "
                "(warmup_steps below 1 is a ratio too)"
            )

    def _check_scheduler_kwargs(self, p: list[str]) -> None:
        name, given = self.lr_scheduler_type, self.lr_scheduler_kwargs
        if name not in SCHEDULERS or not isinstance(given, (dict, type(None))):
            return
        if not given and name not in SCHEDULES_WITH_REQUIRED_KWARGS:
            return
        accepted, required = schedule_keywords(name)
        key, given = self._key("lr_scheduler_kwargs"), given or {}
        unknown = [k for k in given if k not in accepted]
        if unknown:
            takes = f"it takes {list(accepted)}" if accepted else "it takes none"
            p.append(f"{key} has {unknown}, which schedule {name!r} does not take; {takes}")
        for needed in required:
            if not any(option in given for option in needed.split("|")):
                p.append(
                    f"{self._key('lr_scheduler_type')} {name!r} needs lr_scheduler_kwargs with "
                    f"{' or '.join(needed.split('|'))} (got {given or None!r})"
                )
