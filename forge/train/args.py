"""TrainingArguments: the flat, validated settings every forge trainer reads.

Names follow Hugging Face ``TrainingArguments`` where one exists, so a user who knows
that class knows this one. Values arrive from YAML, so the dataclass accepts lists where
it stores tuples, integers where it stores floats, and numeric strings such as ``3e-4``
(which YAML 1.1 reads as a string). ``__post_init__`` checks every field and raises one
``TrainingArgumentsError`` that lists every problem, each naming its config key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from os import PathLike
from typing import Any, ClassVar

__all__ = ["TrainingArguments", "TrainingArgumentsError", "REPORTERS"]

REPORTERS = ("progress", "jsonl", "tensorboard")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES = ("steps", "epoch", "no")
DDP_BACKENDS = ("gloo", "nccl", "mpi", "xccl")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")


class TrainingArgumentsError(ValueError):
    """One or more training arguments are invalid; ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid training arguments ({len(self.problems)}):\n{lines}")


@dataclass
class TrainingArguments:
    """Settings of a training run; see the module docstring for accepted value types.

    Checkpoints go to ``<output_dir>/checkpoints``; ``metrics.jsonl`` and ``tb/`` go to
    ``output_dir``. ``max_steps > 0`` overrides ``num_train_epochs``. ``eval_steps``
    defaults to ``save_steps`` so that every checkpoint carries the metric used to pick
    the best one; evaluation runs only when the trainer has an ``eval_dataset``.
    ``warmup_steps > 0`` overrides ``warmup_ratio`` (as in HF). ``max_grad_norm`` 0 or null
    turns clipping off (the norm is still computed, to skip non-finite steps).
    ``tf32`` (null: torch's default) and ``full_determinism`` are Hugging Face's options, applied
    while ``train()`` runs (forge/train/precision.py).
    """

    output_dir: str
    max_steps: int = -1
    num_train_epochs: float = 1.0
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    eval_strategy: str = "steps"
    eval_steps: int | None = None
    logging_steps: int = 10
    logging_first_step: bool = False
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    save_final_checkpoint: bool = True
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    early_stopping_patience: int | None = None
    early_stopping_threshold: float = 0.0
    seed: int = 42
    data_seed: int | None = None
    bf16: bool = False
    fp16: bool = False
    torch_compile: bool = False
    device: str = "auto"
    ddp_backend: str | None = None
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = True
    skip_nonfinite: bool = True
    max_eval_batches: int | None = None
    resume_from_checkpoint: bool | str = False
    save_optimizer_state: bool = True
    save_scheduler_state: bool = True
    save_rng_state: bool = True
    save_dataloader_state: bool = True
    restore_optimizer_state: bool = True
    restore_scheduler_state: bool = True
    restore_rng_state: bool = True
    restore_dataloader_state: bool = True
    report_to: tuple[str, ...] = REPORTERS
    disable_tqdm: bool = False
    tf32: bool | None = None
    full_determinism: bool = False

    #: prefix of every key named in an error message (where these arguments sit in a config)
    config_key: ClassVar[str] = "trainer.args"

    def __post_init__(self) -> None:
        problems = self.validate()
        if problems:
            raise TrainingArgumentsError(problems)

    # ------------------------------------------------------------------ validation
    def validate(self) -> list[str]:
        """Normalise YAML-friendly values in place and return every problem found.

        Subclasses (other trainers' arguments) extend this with ``super().validate()``.
        """
        p: list[str] = []
        self._check_required(p)
        self._check_schedule(p)
        self._check_optimizer(p)
        self._check_eval_and_save(p)
        self._check_runtime(p)
        self._check_state_flags(p)
        self._check_numerics(p)
        return p

    def _check_required(self, p: list[str]) -> None:
        if isinstance(self.output_dir, PathLike):
            self.output_dir = str(self.output_dir)
        if not isinstance(self.output_dir, str) or not self.output_dir.strip():
            p.append(
                f"{self._key('output_dir')} must be a non-empty path (got {self.output_dir!r}); "
                "set it to the run directory"
            )

    def _check_schedule(self, p: list[str]) -> None:
        max_steps = _as_int(self.max_steps)
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
        self._choice("lr_scheduler_type", SCHEDULERS, p)
        self._int("warmup_steps", p, minimum=0)
        self._float("warmup_ratio", p, minimum=0.0, maximum=1.0)
        self._int("logging_steps", p, minimum=1)
        self._bool("logging_first_step", p)

    def _check_optimizer(self, p: list[str]) -> None:
        self._float("learning_rate", p, minimum=0.0)
        self._float("weight_decay", p, minimum=0.0)
        self._float("adam_beta1", p, minimum=0.0, maximum=1.0, open_max=True)
        self._float("adam_beta2", p, minimum=0.0, maximum=1.0, open_max=True)
        self._float("adam_epsilon", p, positive=True)
        if self.max_grad_norm is not None:
            self._float("max_grad_norm", p, minimum=0.0, fix="use 0 or null to disable clipping")
        self._bool("skip_nonfinite", p)

    def _check_eval_and_save(self, p: list[str]) -> None:
        self._choice("eval_strategy", STRATEGIES, p)
        self._choice("save_strategy", STRATEGIES, p)
        if self.save_strategy == "steps":
            self._int("save_steps", p, minimum=1, fix='set it or use save_strategy: "no"')
        if self.eval_steps is not None:
            self._int("eval_steps", p, minimum=1, fix='set it or use eval_strategy: "no"')
        elif self.eval_strategy == "steps":
            save_steps = _as_int(self.save_steps)
            if save_steps is not None and save_steps >= 1:
                self.eval_steps = save_steps
            elif self.save_strategy != "steps":  # else save_steps is reported above
                p.append(
                    f"{self._key('eval_steps')} must be a positive integer (got None and "
                    f'save_steps {self.save_steps!r}); set it or use eval_strategy: "no"'
                )
        self._optional_int("save_total_limit", p, minimum=1, fix="use null to keep all")
        self._bool("save_final_checkpoint", p)
        self._optional_int("max_eval_batches", p, minimum=1, fix="use null for the whole set")
        if self.metric_for_best_model is not None and not (
            isinstance(self.metric_for_best_model, str) and self.metric_for_best_model
        ):
            p.append(
                f"{self._key('metric_for_best_model')} must be a metric name such as "
                f'"eval_loss" (got {self.metric_for_best_model!r})'
            )
        if self.greater_is_better is not None:
            self._bool("greater_is_better", p)
        self._bool("load_best_model_at_end", p)
        self._optional_int("early_stopping_patience", p, minimum=1, fix="use null to disable")
        self._float("early_stopping_threshold", p, minimum=0.0)
        needs_metric = self.load_best_model_at_end is True or self.early_stopping_patience
        if needs_metric and self.metric_for_best_model is None:
            self.metric_for_best_model = "eval_loss"
        if isinstance(self.metric_for_best_model, str) and self.metric_for_best_model:
            if not self.metric_for_best_model.startswith("eval_"):
                self.metric_for_best_model = f"eval_{self.metric_for_best_model}"
            if self.greater_is_better is None:
                self.greater_is_better = "loss" not in self.metric_for_best_model
        if needs_metric and self.eval_strategy == "no":
            p.append(
                f'{self._key("eval_strategy")} must not be "no" when load_best_model_at_end or '
                'early_stopping_patience is set; use eval_strategy: "steps" or "epoch"'
            )
        if self.load_best_model_at_end is True:
            self._check_best_model_alignment(p)

    def _check_best_model_alignment(self, p: list[str]) -> None:
        if self.save_strategy == "no":
            p.append(
                f'{self._key("load_best_model_at_end")} needs checkpoints (save_strategy is "no"); '
                'use save_strategy: "steps" or "epoch"'
            )
        elif self.eval_strategy in STRATEGIES and self.eval_strategy != "no":
            if self.save_strategy != self.eval_strategy:
                p.append(
                    f"{self._key('save_strategy')} must equal eval_strategy when "
                    f"load_best_model_at_end is set (got {self.save_strategy!r} and "
                    f"{self.eval_strategy!r}); set both to the same value"
                )
            elif (
                self.save_strategy == "steps"
                and isinstance(self.save_steps, int)
                and isinstance(self.eval_steps, int)
                and self.save_steps % self.eval_steps != 0
            ):
                p.append(
                    f"{self._key('save_steps')} must be a multiple of eval_steps when "
                    f"load_best_model_at_end is set (got {self.save_steps} and {self.eval_steps}); "
                    "make every checkpoint step an evaluation step"
                )

    def _check_runtime(self, p: list[str]) -> None:
        self._int("seed", p, minimum=0)
        self._optional_int("data_seed", p, minimum=0, fix="use null to reuse seed")
        for name in ("bf16", "fp16", "torch_compile", "disable_tqdm", "dataloader_drop_last"):
            self._bool(name, p)
        if self.bf16 is True and self.fp16 is True:
            p.append(f"{self._key('fp16')} and bf16 are both true; enable at most one")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            p.append(
                f"{self._key('device')} must be auto, cpu, cuda, cuda:N, mps or xpu "
                f"(got {self.device!r})"
            )
        if self.ddp_backend is not None:
            self._choice("ddp_backend", DDP_BACKENDS, p, fix="or null to pick by device")
        self._int("dataloader_num_workers", p, minimum=0)
        self._check_report_to(p)
        resume = self.resume_from_checkpoint
        if isinstance(resume, PathLike):
            self.resume_from_checkpoint = str(resume)
        elif not isinstance(resume, (bool, str)) or resume == "":
            p.append(
                f"{self._key('resume_from_checkpoint')} must be true, false or a checkpoint "
                f"path (got {resume!r})"
            )

    def _check_report_to(self, p: list[str]) -> None:
        value = self.report_to
        if value is None or value == "none":
            value = ()
        elif value == "all":
            value = REPORTERS
        elif isinstance(value, str):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            p.append(
                f"{self._key('report_to')} must be a list of {list(REPORTERS)} (got {value!r})"
            )
            return
        unknown = [v for v in value if v not in REPORTERS]
        if unknown:
            p.append(
                f"{self._key('report_to')} has unknown reporters {unknown}; "
                f"choose from {list(REPORTERS)}, or use none"
            )
        self.report_to = tuple(value)

    def _check_state_flags(self, p: list[str]) -> None:
        for f in fields(self):
            if f.name.startswith(("save_", "restore_")) and f.name.endswith("_state"):
                self._bool(f.name, p)

    def _check_numerics(self, p: list[str]) -> None:
        if self.tf32 is not None:
            self._bool("tf32", p)
        self._bool("full_determinism", p)

    # ------------------------------------------------------------------ helpers
    def _key(self, name: str) -> str:
        return f"{self.config_key}.{name}"

    def _bool(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            p.append(f"{self._key(name)} must be true or false (got {value!r})")

    def _choice(self, name: str, choices: tuple[str, ...], p: list[str], fix: str = "") -> None:
        value = getattr(self, name)
        if value not in choices:
            options = ", ".join(f'"{c}"' for c in choices)
            p.append(
                f"{self._key(name)} must be one of {options} (got {value!r})"
                + (f" {fix}" if fix else "")
            )

    def _int(self, name: str, p: list[str], minimum: int, fix: str = "") -> None:
        value = _as_int(getattr(self, name))
        if value is None or value < minimum:
            what = {0: "a non-negative integer", 1: "a positive integer"}.get(
                minimum, f"an integer >= {minimum}"
            )
            p.append(
                f"{self._key(name)} must be {what} (got {getattr(self, name)!r})"
                + (f"; {fix}" if fix else "")
            )
            return
        setattr(self, name, value)

    def _optional_int(self, name: str, p: list[str], minimum: int, fix: str = "") -> None:
        if getattr(self, name) is not None:
            self._int(name, p, minimum, fix)

    def _float(
        self,
        name: str,
        p: list[str],
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        positive: bool = False,
        open_max: bool = False,
        fix: str = "",
    ) -> None:
        value = _as_float(getattr(self, name))
        bad = value is None or not math.isfinite(value)
        if not bad:
            bad = (
                (positive and value <= 0)
                or (minimum is not None and value < minimum)
                or (maximum is not None and (value >= maximum if open_max else value > maximum))
            )
        if bad:
            if positive:
                what = "a positive number"
            elif maximum is not None:
                what = f"a number in [{minimum}, {maximum}{')' if open_max else ']'}"
            else:
                what = f"a number >= {minimum}"
            p.append(
                f"{self._key(name)} must be {what} (got {getattr(self, name)!r})"
                + (f"; {fix}" if fix else "")
            )
            return
        setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (tuples as lists), e.g. for run metadata."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def _as_int(value: Any) -> int | None:
    """An int from an int, an integral float, or a numeric string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number = _as_float(value)
    if number is not None and math.isfinite(number) and number.is_integer():
        return int(number)
    return None


def _as_float(value: Any) -> float | None:
    """A float from a number or a numeric string such as ``"3e-4"``; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
