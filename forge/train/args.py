"""TrainingArguments: the flat, validated settings every forge trainer reads.

Every name of Hugging Face ``transformers.TrainingArguments`` (5.x) is a field here with HF's
meaning and default, so an HF script's arguments carry over unchanged; forge adds a few of its
own (``device``, ``early_stopping_*``, ``save_*_state`` / ``restore_*_state``, ...). The few HF
names that do not apply to forge (pushing to the Hub, DeepSpeed/FSDP plugins, ...) accept only
their default value and name the reason otherwise (``NOT_APPLICABLE``; the README has the table).

Values arrive from YAML, so the dataclass accepts lists where it stores tuples, integers where
it stores floats, and numeric strings such as ``3e-4`` (which YAML 1.1 reads as a string).
``validate()`` checks every field and ``__post_init__`` raises one ``TrainingArgumentsError``
listing every problem, each naming its config key. ``forge_check_values`` runs the same checks
on a config's literal values, so ``forge train --dry-run`` and ``forge ls`` report them before
anything is built. This module never imports torch.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from os import PathLike
from typing import Any, ClassVar

from forge.extras import install_command, is_installed

__all__ = [
    "INTEGRATIONS",
    "NOT_APPLICABLE",
    "OPTIMIZERS",
    "SCHEDULERS",
    "TrainingArguments",
    "TrainingArgumentsError",
]

#: ``lr_scheduler_type`` values: every schedule of ``transformers.get_scheduler``
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)
#: schedules stepped with the evaluation metric (``metric_for_best_model``), not every step
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
_SCHEDULES_WITH_REQUIRED_KWARGS = (
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)

#: ``optim`` values forge builds, each a torch optimizer (adafactor: transformers' Adafactor),
#: and the ``optim_args`` keys each takes (as HF's Trainer reads them)
OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw_torch": (),
    "adamw_torch_fused": (),
    "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr_decay", "weight_decay", "eps"),
    "rmsprop": ("momentum", "alpha", "eps", "weight_decay", "centered"),
    "adafactor": (),
}
#: HF ``optim`` names forge does not build (they need other libraries or their own loops)
OTHER_HF_OPTIMIZERS = (
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adamw_anyprecision",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ademamix",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "lomo",
    "adalomo",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "stable_adamw",
)

#: ``report_to`` integrations forge runs (rank 0), and the package each needs
INTEGRATIONS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
#: HF integrations forge has no callback for
OTHER_HF_INTEGRATIONS = (
    "azure_ml",
    "clearml",
    "codecarbon",
    "comet_ml",
    "dagshub",
    "dvclive",
    "flyte",
    "kubeflow",
    "neptune",
    "swanlab",
    "trackio",
)

STRATEGIES = ("steps", "epoch", "no")
SAVE_STRATEGIES = ("steps", "epoch", "best", "no")
SAMPLING = ("random", "sequential")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
TOKEN_COUNTS = ("no", "all", "non_padding")
METRIC_INCLUDES = ("inputs", "loss")
DDP_BACKENDS = ("gloo", "nccl", "mpi", "xccl", "ccl", "hccl", "cncl", "mccl")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")

#: why FSDP, DeepSpeed and other parameter or optimizer-state sharding are refused (here and by
#: the Accelerate trainer, which reads them from an accelerate config)
SHARDING_UNSUPPORTED = (
    "forge does not shard parameters or optimizer state yet: its checkpoints hold the whole "
    "weights and optimizer state, which a sharded run would hold one shard of; train with DDP "
    "(the plain or Accelerate trainer with --nproc N) or split the model with the pipeline trainer"
)

#: HF names that do not apply to forge: the values accepted (HF's default, and any that mean
#: the same in forge) and why others are refused
NOT_APPLICABLE: dict[str, tuple[tuple[Any, ...], str]] = {
    "optim_target_modules": (
        (None,),
        "it selects layers for GaLore/Apollo, which forge does not build",
    ),
    "use_liger_kernel": ((False,), "Liger kernels patch models; forge trains the model as given"),
    "liger_kernel_config": ((None,), "Liger kernels patch models; forge trains the model as given"),
    "neftune_noise_alpha": ((None,), "NEFTune noise is not implemented"),
    "auto_find_batch_size": ((False,), "forge runs the batch size it is given"),
    "save_on_each_node": (
        (False,),
        "forge writes each checkpoint once, from the ranks that own its files",
    ),
    "push_to_hub": (
        (False,),
        "forge does not upload; push a checkpoint directory with huggingface_hub",
    ),
    "hub_token": ((None,), "forge does not upload to the Hub"),
    "hub_private_repo": ((None,), "forge does not upload to the Hub"),
    "hub_model_id": ((None,), "forge does not upload to the Hub"),
    "hub_strategy": (("every_save",), "forge does not upload to the Hub"),
    "hub_always_push": ((False,), "forge does not upload to the Hub"),
    "hub_revision": ((None,), "forge does not upload to the Hub"),
    "trackio_space_id": ((None,), "forge has no trackio integration"),
    "trackio_bucket_id": ((None,), "forge has no trackio integration"),
    "trackio_static_space_id": ((None,), "forge has no trackio integration"),
    "accelerator_config": (
        (None,),
        "the Accelerate trainer takes its settings as its own arguments (mixed_precision, "
        "split_batches)",
    ),
    "parallelism_config": ((None,), "forge's trainers set up their own parallelism"),
    "fsdp": ((None, "", False), SHARDING_UNSUPPORTED),
    "fsdp_config": ((None,), SHARDING_UNSUPPORTED),
    "deepspeed": ((None,), SHARDING_UNSUPPORTED),
    "debug": (("", None), "HF's debug options are for its TPU and underflow tools"),
    "skip_memory_metrics": ((True,), "forge does not report memory metrics"),
    "dataloader_in_order": ((True,), "exact resume needs batches in order"),
    "length_column_name": (("length",), "it is only read by group_by_length sampling"),
}


class TrainingArgumentsError(ValueError):
    """One or more training arguments are invalid; ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid training arguments ({len(self.problems)}):\n{lines}")


@dataclass
class TrainingArguments:
    """Settings of a training run, named and defaulted as Hugging Face's ``TrainingArguments``.

    Checkpoints go to ``<output_dir>/checkpoints``; ``metrics.jsonl`` and ``tb/`` go to
    ``output_dir``. ``max_steps > 0`` overrides ``num_train_epochs``. ``logging_steps``,
    ``eval_steps`` and ``save_steps`` below 1 are fractions of the training steps;
    ``eval_steps`` defaults to ``logging_steps``; ``warmup_steps`` below 1 is a fraction of
    the training steps (``warmup_ratio``, HF 4.x's name, is also read). ``max_grad_norm`` 0
    or null turns clipping off (the norm is still computed, to skip non-finite steps).
    Evaluation needs the trainer's ``eval_dataset``.
    ``tf32`` (null: torch's default) and ``full_determinism`` are applied while ``train()``
    runs (forge/train/precision.py).
    """

    output_dir: str | None = None
    # ---- length and batches
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    # ---- optimizer
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    optim_target_modules: Any = None
    max_grad_norm: float | None = 1.0
    label_smoothing_factor: float = 0.0
    # ---- learning-rate schedule
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    # ---- precision, memory, speed
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    tf32: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    gradient_checkpointing: bool | None = None
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    activation_checkpointing_modules: tuple[str, ...] | None = None  # forge's own (below)
    activation_checkpointing_every: int = 1
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    use_liger_kernel: bool = False
    liger_kernel_config: dict[str, bool] | None = None
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    auto_find_batch_size: bool = False
    # ---- logging and reporting
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    log_level: str = "passive"
    log_level_replica: str = "warning"
    disable_tqdm: bool | None = None
    report_to: Any = "none"
    run_name: str | None = None
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: Any = None
    # ---- evaluation
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    prediction_loss_only: bool = False
    eval_on_start: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    include_for_metrics: list[str] = field(default_factory=list)
    batch_eval_metrics: bool = False
    # ---- checkpoints
    save_only_model: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_on_each_node: bool = False
    save_total_limit: int | None = None
    enable_jit_checkpoint: bool = False
    push_to_hub: bool = False
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    # ---- reproducibility and devices
    full_determinism: bool = False
    seed: int = 42
    data_seed: int | None = None
    use_cpu: bool = False
    accelerator_config: Any = None
    parallelism_config: Any = None
    # ---- data loading
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    dataloader_in_order: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    # ---- distributed
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    fsdp: Any = None
    fsdp_config: Any = None
    deepspeed: Any = None
    debug: Any = ""
    skip_memory_metrics: bool = True
    # ---- HF script flags (read by scripts, not by the trainer, in HF as here)
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    resume_from_checkpoint: bool | str | None = None
    local_rank: int = -1
    # ---- forge's own
    device: str = "auto"
    save_final_checkpoint: bool = True
    early_stopping_patience: int | None = None
    early_stopping_threshold: float = 0.0
    skip_nonfinite: bool = True
    max_eval_batches: int | None = None
    save_optimizer_state: bool = True
    save_scheduler_state: bool = True
    save_rng_state: bool = True
    save_dataloader_state: bool = True
    restore_optimizer_state: bool = True
    restore_scheduler_state: bool = True
    restore_rng_state: bool = True
    restore_dataloader_state: bool = True

    #: prefix of every key named in an error message (where these arguments sit in a config)
    config_key: ClassVar[str] = "trainer.args"

    def __post_init__(self) -> None:
        problems = self.validate()
        if problems:
            raise TrainingArgumentsError(problems)

    # ------------------------------------------------------------------ config check
    @classmethod
    def forge_check_values(
        cls, values: dict[str, Any], computed: Iterable[str] = ()
    ) -> list[tuple[str | None, str]]:
        """The problems ``validate`` finds in a config's literal ``values``, as
        ``(argument, message)`` pairs; arguments in ``computed`` (known only at build time)
        keep their defaults and their problems are left to the build.

        ``forge`` calls this while checking a config, so bad values are reported by
        ``forge ls``, ``--dry-run`` and before a run directory is made.
        """
        computed = set(computed)
        args = cls.__new__(cls)
        for f in fields(cls):
            if not f.init:
                continue
            if f.default is not MISSING:
                setattr(args, f.name, f.default)
            elif f.default_factory is not MISSING:
                setattr(args, f.name, f.default_factory())
        for name, value in values.items():
            if name not in computed and hasattr(args, name):
                setattr(args, name, value)
        found = []
        prefix = re.compile(rf"^{re.escape(cls.config_key)}\.(\w+)")
        for message in args.validate():
            match = prefix.match(message)
            name = match.group(1) if match else None
            if name not in computed:
                found.append((name, message))
        return found

    # ------------------------------------------------------------------ validation
    def validate(self) -> list[str]:
        """Normalise YAML-friendly values in place and return every problem found.

        Subclasses (other trainers' arguments) extend this with ``super().validate()``.
        """
        p: list[str] = []
        self._check_output(p)
        self._check_length(p)
        self._check_optimizer(p)
        self._check_schedule(p)
        self._check_precision(p)
        self._check_logging(p)
        self._check_evaluation(p)
        self._check_saving(p)
        self._check_best_model(p)
        self._check_runtime(p)
        self._check_data(p)
        self._check_distributed(p)
        self._check_not_applicable(p)
        return p

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
                f"library or its own training loop); use one of {_quoted(OPTIMIZERS)}, or pass "
                "the optimizer itself in the config's optimizer block"
            )
            return
        if optim not in OPTIMIZERS:
            self._choice("optim", tuple(OPTIMIZERS), p)
            return
        if self.optim_args is not None:
            self._check_optim_args(p)

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
            elif name not in ("nesterov", "centered") and _as_float(value) is None:
                p.append(f"{key}: {name} must be a number (got {value!r})")

    def parsed_optim_args(self) -> dict[str, Any]:
        """``optim_args`` ("momentum=0.9,nesterov=true") as optimizer keywords."""
        out: dict[str, Any] = {}
        for item in filter(None, (self.optim_args or "").replace(" ", "").split(",")):
            name, _, value = item.partition("=")
            if name in ("nesterov", "centered"):
                out[name] = value.lower() in ("true", "1", "yes")
            else:
                out[name] = float(value)
        return out

    def _check_schedule(self, p: list[str]) -> None:
        self._choice("lr_scheduler_type", SCHEDULERS, p)
        self._dict("lr_scheduler_kwargs", p)
        self._check_scheduler_kwargs(p)
        warmup = _as_float(self.warmup_steps)
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
        if not given and name not in _SCHEDULES_WITH_REQUIRED_KWARGS:
            return
        from forge.train.optim import schedule_keywords  # transformers: only when needed

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

    def _check_precision(self, p: list[str]) -> None:
        for name in ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval", "torch_compile"):
            self._bool(name, p)
        if self.bf16 is True and self.fp16 is True:
            p.append(f"{self._key('fp16')} and bf16 are both true; enable at most one")
        if self.bf16_full_eval is True and self.fp16_full_eval is True:
            p.append(f"{self._key('fp16_full_eval')} and bf16_full_eval are both true; enable one")
        for name in ("tf32", "activation_checkpointing", "gradient_checkpointing"):
            self._optional_bool(name, p)
        for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
            self._dict(name, p)
        # gradient_checkpointing is HF's older name; both names end up saying the same
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        self._check_activation_checkpointing(p)
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False
        for name in ("torch_compile_backend", "torch_compile_mode"):
            if getattr(self, name) is not None:
                self._string(name, p)
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # as HF: naming a backend or mode turns compiling on
        self._bool("use_cache", p)
        self._optional_int("torch_empty_cache_steps", p, minimum=1, fix="use null to never")

    def _check_activation_checkpointing(self, p: list[str]) -> None:
        """forge's own activation-checkpointing arguments (forge/train/transforms.py).

        ``activation_checkpointing_modules``: the blocks to wrap, as module paths
        (``model.layers.3``; a module list such as ``model.layers`` wraps each of its
        children) or class names (``LlamaDecoderLayer``); null: a Hugging Face model's own
        ``gradient_checkpointing_enable``, else the model's repeated layers.
        ``activation_checkpointing_every``: wrap every k-th of them (layers 0, k, 2k, ...),
        keeping the others' activations (HF 5's ``every_n_layers``, also read from
        ``activation_checkpointing_kwargs``). Setting either of these two turns activation
        checkpointing on (as naming a compile backend turns ``torch_compile`` on).
        """
        names = self.activation_checkpointing_modules
        key = self._key("activation_checkpointing_modules")
        if isinstance(names, str):
            names = (names,)
        if names is not None and (
            not isinstance(names, (list, tuple))
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            p.append(
                f"{key} must be a list of module paths or class names (e.g. [model.layers]) or "
                f"null for the model's repeated layers (got {self.activation_checkpointing_modules!r})"
            )
            names = None
        self.activation_checkpointing_modules = None if names is None else tuple(names)
        asked = names is not None or self.activation_checkpointing_every != 1
        kwargs = self.activation_checkpointing_kwargs
        every_key = self._key("activation_checkpointing_every")
        if isinstance(kwargs, dict) and "every_n_layers" in kwargs:
            if self.activation_checkpointing_every not in (1, kwargs["every_n_layers"]):
                p.append(
                    f"{every_key} and activation_checkpointing_kwargs.every_n_layers are both "
                    "set; set activation_checkpointing_every only"
                )
            self.activation_checkpointing_every = kwargs["every_n_layers"]
            kwargs = {k: v for k, v in kwargs.items() if k != "every_n_layers"}
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs = kwargs
        self._int("activation_checkpointing_every", p, minimum=1, fix="1 wraps every block")
        if asked:  # as naming a compile backend turns torch_compile on
            self.activation_checkpointing = self.gradient_checkpointing = True

    def _check_logging(self, p: list[str]) -> None:
        self._choice("logging_strategy", STRATEGIES, p)
        if self.logging_strategy == "steps":
            self._interval("logging_steps", p, 'use logging_strategy: "no" to log nothing')
        for name in ("logging_first_step", "log_on_each_node", "logging_nan_inf_filter"):
            self._bool(name, p)
        tokens = self.include_num_input_tokens_seen
        if isinstance(tokens, bool):
            self.include_num_input_tokens_seen = "all" if tokens else "no"
        else:
            self._choice("include_num_input_tokens_seen", TOKEN_COUNTS, p, fix="or true/false")
        self._choice("log_level", LOG_LEVELS, p)
        self._choice("log_level_replica", LOG_LEVELS, p)
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        self._bool("disable_tqdm", p)
        self._check_report_to(p)
        if self.run_name is not None:
            self._string("run_name", p)
        self._string("project", p)

    def _check_report_to(self, p: list[str]) -> None:
        key, value = self._key("report_to"), self.report_to
        if value is None or value == "none" or value == ["none"]:
            value = ()
        elif value == "all" or value == ["all"]:
            value = tuple(name for name, package in INTEGRATIONS.items() if is_installed(package))
        elif isinstance(value, str):
            value = (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            p.append(f"{key} must be an integration name or a list of them (got {value!r})")
            return
        self.report_to = tuple(value)
        for name in value:
            if name in ("progress", "jsonl"):
                p.append(
                    f"{key} names {name!r}, which is not an integration: the console progress "
                    "(plain lines with disable_tqdm: true) and metrics.jsonl are always written; "
                    "remove it"
                )
            elif name in OTHER_HF_INTEGRATIONS:
                p.append(
                    f"{key} {name!r} is an HF integration forge has no callback for; use "
                    f"{_quoted(INTEGRATIONS)}, or add your own TrainerCallback to callbacks"
                )
            elif name not in INTEGRATIONS:
                p.append(
                    f"{key} has an unknown integration {name!r}; choose from "
                    f'{_quoted(INTEGRATIONS)}, "all" or "none"'
                )
            elif not is_installed(INTEGRATIONS[name]):
                p.append(
                    f"{key} {name!r} needs the {INTEGRATIONS[name]} package, which is not "
                    f"installed; {install_command(INTEGRATIONS[name])} (forge runs it offline: "
                    "files under output_dir), or remove it"
                )

    def _check_evaluation(self, p: list[str]) -> None:
        self._choice("eval_strategy", STRATEGIES, p)
        if self.eval_strategy == "steps":
            if self.eval_steps is None or self.eval_steps == 0:
                self.eval_steps = self.logging_steps  # HF's default
            self._interval("eval_steps", p, 'set it or use eval_strategy: "no"')
        elif self.eval_steps is not None:
            self._interval("eval_steps", p, 'set it or use eval_strategy: "no"')
        self._float("eval_delay", p, minimum=0.0)
        for name in (
            "prediction_loss_only",
            "eval_on_start",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "batch_eval_metrics",
        ):
            self._bool(name, p)
        self._optional_int("eval_accumulation_steps", p, minimum=1, fix="use null to keep all")
        self._optional_int("max_eval_batches", p, minimum=1, fix="use null for the whole set")
        include = self.include_for_metrics
        if isinstance(include, str):
            include = [include]
        if not isinstance(include, (list, tuple)) or any(i not in METRIC_INCLUDES for i in include):
            p.append(
                f"{self._key('include_for_metrics')} must be a list of {list(METRIC_INCLUDES)} "
                f"(got {self.include_for_metrics!r})"
            )
        else:
            self.include_for_metrics = list(include)

    def _check_saving(self, p: list[str]) -> None:
        self._choice("save_strategy", SAVE_STRATEGIES, p)
        if self.save_strategy == "steps":
            self._interval("save_steps", p, 'set it or use save_strategy: "no"')
        self._optional_int("save_total_limit", p, minimum=1, fix="use null to keep all")
        for name in ("save_final_checkpoint", "save_only_model", "enable_jit_checkpoint"):
            self._bool(name, p)
        for name in ("ignore_data_skip", "restore_callback_states_from_checkpoint"):
            self._bool(name, p)
        for f in fields(self):
            if f.name.startswith(("save_", "restore_")) and f.name.endswith("_state"):
                self._bool(f.name, p)
        if self.save_only_model is True:  # HF: weights only; the run cannot be resumed exactly
            self.save_optimizer_state = self.save_scheduler_state = False
            self.save_rng_state = self.save_dataloader_state = False
        if self.ignore_data_skip is True:  # HF: a resumed run starts its epoch afresh
            self.restore_dataloader_state = False

    def _check_best_model(self, p: list[str]) -> None:
        metric = self.metric_for_best_model
        if metric is not None and not (isinstance(metric, str) and metric):
            p.append(
                f"{self._key('metric_for_best_model')} must be a metric name such as "
                f'"eval_loss" or "accuracy" (got {metric!r})'
            )
            metric = self.metric_for_best_model = None
        if self.greater_is_better is not None:
            self._bool("greater_is_better", p)
        self._bool("load_best_model_at_end", p)
        self._optional_int("early_stopping_patience", p, minimum=1, fix="use null to disable")
        self._float("early_stopping_threshold", p, minimum=0.0)
        needs_metric = [
            name
            for name, on in (
                ("load_best_model_at_end", self.load_best_model_at_end is True),
                ("early_stopping_patience", bool(self.early_stopping_patience)),
                ('save_strategy: "best"', self.save_strategy == "best"),
                ("lr_scheduler_type", self.lr_scheduler_type in METRIC_SCHEDULERS),
            )
            if on
        ]
        if needs_metric and metric is None:
            metric = "loss"  # HF's default for these
        if metric is not None:
            if not metric.startswith("eval_"):
                metric = f"eval_{metric}"
            self.metric_for_best_model = metric
            if self.greater_is_better is None:
                self.greater_is_better = not metric.endswith("loss")
        if needs_metric and self.eval_strategy == "no":
            p.append(
                f'{self._key("eval_strategy")} must not be "no" when {" and ".join(needs_metric)} '
                'is set: they read evaluation metrics; use eval_strategy: "steps" or "epoch"'
            )
        if self.load_best_model_at_end is True and self.save_strategy != "best":
            self._check_best_model_alignment(p)

    def _check_best_model_alignment(self, p: list[str]) -> None:
        if self.save_strategy == "no":
            p.append(
                f'{self._key("load_best_model_at_end")} needs checkpoints (save_strategy is "no"); '
                'use save_strategy: "steps", "epoch" or "best"'
            )
        elif self.eval_strategy in STRATEGIES and self.eval_strategy != "no":
            if self.save_strategy != self.eval_strategy:
                p.append(
                    f"{self._key('save_strategy')} must equal eval_strategy when "
                    f"load_best_model_at_end is set (got {self.save_strategy!r} and "
                    f'{self.eval_strategy!r}); set both to the same value, or save_strategy: "best"'
                )
            elif self.save_strategy == "steps":
                save, every = _as_float(self.save_steps), _as_float(self.eval_steps)
                if save and every and _not_multiple(save, every):
                    p.append(
                        f"{self._key('save_steps')} must be a multiple of eval_steps when "
                        f"load_best_model_at_end is set (got {self.save_steps} and "
                        f"{self.eval_steps}); make every checkpoint step an evaluation step"
                    )

    def _check_runtime(self, p: list[str]) -> None:
        self._int("seed", p, minimum=0)
        self._optional_int("data_seed", p, minimum=0, fix="use null to reuse seed")
        for name in ("full_determinism", "use_cpu", "do_train", "do_eval", "do_predict"):
            self._bool(name, p)
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            p.append(
                f"{self._key('device')} must be auto, cpu, cuda, cuda:N, mps or xpu "
                f"(got {self.device!r})"
            )
        elif self.use_cpu is True:
            if self.device not in ("auto", "cpu"):
                p.append(
                    f"{self._key('use_cpu')} is true but device is {self.device!r}; set one of them"
                )
            self.device = "cpu"
        self._int("local_rank", p, minimum=-1)
        resume = self.resume_from_checkpoint
        if isinstance(resume, PathLike):
            self.resume_from_checkpoint = str(resume)
        elif resume is None:
            self.resume_from_checkpoint = False
        elif not isinstance(resume, (bool, str)) or resume == "":
            p.append(
                f"{self._key('resume_from_checkpoint')} must be true, false or a checkpoint "
                f"path (got {resume!r})"
            )

    def _check_data(self, p: list[str]) -> None:
        for name in (
            "dataloader_drop_last",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "remove_unused_columns",
        ):
            self._bool(name, p)
        self._int("dataloader_num_workers", p, minimum=0)
        self._optional_int("dataloader_prefetch_factor", p, minimum=1, fix="or null")
        workers = self.dataloader_num_workers
        if isinstance(workers, int) and workers == 0:
            for name in ("dataloader_prefetch_factor", "dataloader_multiprocessing_context"):
                if getattr(self, name) is not None:
                    p.append(
                        f"{self._key(name)} applies to worker processes, and "
                        "dataloader_num_workers is 0; set dataloader_num_workers or remove it"
                    )
            if self.dataloader_persistent_workers is True:
                p.append(
                    f"{self._key('dataloader_persistent_workers')} needs worker processes "
                    "(dataloader_num_workers is 0); set dataloader_num_workers or remove it"
                )
        if self.dataloader_multiprocessing_context is not None:
            self._choice("dataloader_multiprocessing_context", ("fork", "spawn", "forkserver"), p)
        labels = self.label_names
        if isinstance(labels, str):
            labels = [labels]
        if labels is not None and (
            not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) for x in labels)
        ):
            p.append(
                f"{self._key('label_names')} must be a list of batch keys such as "
                f'["labels"] (got {self.label_names!r})'
            )
        elif labels is not None:
            self.label_names = list(labels)
        if self.train_sampling_strategy == "group_by_length":
            p.append(
                f"{self._key('train_sampling_strategy')} group_by_length is not supported "
                '(its batches would change on resume); use "random" or "sequential"'
            )
        else:
            self._choice("train_sampling_strategy", SAMPLING, p)

    def _check_distributed(self, p: list[str]) -> None:
        if self.ddp_backend is not None:
            self._choice("ddp_backend", DDP_BACKENDS, p, fix="or null to pick by device")
        for name in ("ddp_find_unused_parameters", "ddp_broadcast_buffers", "ddp_static_graph"):
            self._optional_bool(name, p)
        self._optional_int("ddp_bucket_cap_mb", p, minimum=1, fix="or null for torch's default")
        self._int("ddp_timeout", p, minimum=1)

    def _check_not_applicable(self, p: list[str]) -> None:
        for name, (accepted, reason) in NOT_APPLICABLE.items():
            value = getattr(self, name)
            if isinstance(value, (list, tuple, dict)) and not value:
                continue  # an empty list or dict says nothing (debug: [], fsdp: [])
            if not any(value is a or (value == a and type(value) is type(a)) for a in accepted):
                p.append(
                    f"{self._key(name)} does not apply to forge: {reason} (got {value!r}; "
                    f"leave it at {accepted[0]!r})"
                )

    # ------------------------------------------------------------------ derived values
    def ddp_kwargs(self) -> dict[str, Any]:
        """The ``ddp_*`` arguments that are set, as ``DistributedDataParallel`` keywords
        (torch's defaults for the others); Accelerate's DDP kwargs handler takes the same."""
        given = {
            "find_unused_parameters": self.ddp_find_unused_parameters,
            "bucket_cap_mb": self.ddp_bucket_cap_mb,
            "broadcast_buffers": self.ddp_broadcast_buffers,
            "static_graph": self.ddp_static_graph,
        }
        return {k: v for k, v in given.items() if v is not None}

    def steps_for(self, name: str, max_steps: int) -> int:
        """``logging_steps`` / ``eval_steps`` / ``save_steps`` as a step count: a value below
        1 is that fraction of ``max_steps``, rounded up (as HF does)."""
        value = getattr(self, name)
        if value is None:
            return 0
        return math.ceil(max_steps * value) if value < 1 else int(value)

    def warmup_steps_for(self, num_training_steps: int) -> int:
        """Warmup steps: ``warmup_steps`` (a fraction when below 1), else ``warmup_ratio``."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps or self.warmup_ratio
        return math.ceil(ratio * num_training_steps)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (tuples as lists), e.g. for run metadata."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    # ------------------------------------------------------------------ helpers
    def _key(self, name: str) -> str:
        return f"{self.config_key}.{name}"

    def _bool(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            p.append(f"{self._key(name)} must be true or false (got {value!r})")

    def _optional_bool(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if value is not None and not isinstance(value, bool):
            p.append(f"{self._key(name)} must be true, false or null (got {value!r})")

    def _string(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if not isinstance(value, str) or not value:
            p.append(f"{self._key(name)} must be a non-empty string (got {value!r})")

    def _dict(self, name: str, p: list[str]) -> None:
        """A mapping, null, or (as HF's command line allows) a JSON object in a string."""
        value = getattr(self, name)
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if value is not None and not isinstance(value, dict):
            p.append(f"{self._key(name)} must be a mapping of keywords or null (got {value!r})")
            return
        setattr(self, name, value)

    def _choice(self, name: str, choices: tuple[str, ...], p: list[str], fix: str = "") -> None:
        value = getattr(self, name)
        if value not in choices:
            p.append(
                f"{self._key(name)} must be one of {_quoted(choices)} (got {value!r})"
                + (f" {fix}" if fix else "")
            )

    def _interval(self, name: str, p: list[str], fix: str) -> None:
        """A step interval: an integer >= 1, or a fraction of the training steps in (0, 1)."""
        value = _as_float(getattr(self, name))
        if value is None or not math.isfinite(value) or value <= 0:
            p.append(
                f"{self._key(name)} must be a positive integer, or a fraction of the training "
                f"steps below 1 (got {getattr(self, name)!r}); {fix}"
            )
        elif value > 1 and not value.is_integer():
            p.append(
                f"{self._key(name)} must be an integer when it is more than 1 "
                f"(got {getattr(self, name)!r}); below 1 it is a fraction of the training steps"
            )
        else:
            setattr(self, name, int(value) if value >= 1 else value)

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


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _not_multiple(value: float, of: float) -> bool:
    # integer arithmetic, so fractions such as 0.2 and 0.1 compare exactly (as HF does)
    return round(value * 1_000_000) % round(of * 1_000_000) != 0


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
