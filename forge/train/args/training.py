"""TrainingArguments: the flat, validated settings every forge trainer reads.

Every name of Hugging Face ``transformers.TrainingArguments`` (5.x) is a field here with HF's
meaning and default, so an HF script's arguments carry over unchanged; forge adds a few of its
own (``device``, ``early_stopping_*``, ``save_*_state`` / ``restore_*_state``, ``ema_*``, ...). The few HF
names that do not apply to forge (pushing to the Hub, DeepSpeed/FSDP plugins, ...) accept only
their default value and name the reason otherwise (``NOT_APPLICABLE``; docs/hf-names.md has the table).

Values arrive from YAML, so the dataclass accepts lists where it stores tuples, integers where
it stores floats, and numeric strings such as ``3e-4`` (which YAML 1.1 reads as a string).
``validate()`` checks every field and ``__post_init__`` raises one ``TrainingArgumentsError``
listing every problem, each naming its config key. ``forge_check_values`` runs the same checks
on a config's literal values, so ``forge train --dry-run`` and ``forge ls`` report them before
anything is built. This module never imports torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from forge.train.args.run_checks import RunChecks
from forge.train.args.step_checks import StepChecks

__all__ = ["TrainingArguments", "TrainingArgumentsError"]


class TrainingArgumentsError(ValueError):
    """One or more training arguments are invalid; ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid training arguments ({len(self.problems)}):\n{lines}")


@dataclass
class TrainingArguments(StepChecks, RunChecks):
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
    ``predict_with_generate`` (with ``generation_max_length``, ``generation_num_beams``,
    ``generation_config``) makes evaluation and prediction generate, as HF's
    ``Seq2SeqTrainer`` (forge/train/generation.py).
    ``ema_decay`` (null or 0: off) keeps a moving average of the trainable parameters, with
    ``ema_warmup_steps`` and ``ema_update_every``; ``eval_with_ema`` evaluates with it
    (forge/train/ema.py has the formula).
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
    #: forge's: evaluate before every checkpoint, so each records its metrics in its manifest
    eval_on_save: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    include_for_metrics: list[str] = field(default_factory=list)
    batch_eval_metrics: bool = False
    # ---- generation in evaluation (HF's Seq2SeqTrainingArguments; forge/train/generation.py)
    sortish_sampler: bool = False  # read by nothing in HF either (NOT_APPLICABLE)
    predict_with_generate: bool = False
    generation_max_length: int | None = None
    generation_num_beams: int | None = None
    generation_config: Any = None  # a directory, a generation_config.json, a mapping, or one
    # ---- checkpoints
    save_only_model: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_on_each_node: bool = False
    save_total_limit: int | None = None
    #: forge's (Lightning's name): the best checkpoints by metric_for_best_model that rotation
    #: never deletes, beside the newest
    save_top_k: int = 1
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
    group_by_length: bool = False  # HF 4.x's name for train_sampling_strategy: group_by_length
    # forge's own (fairseq's max_tokens): batches of at most this many padded tokens per process;
    # when set, it forms the training batches and per_device_train_batch_size does not apply
    # to them (every config carries one: HF's default 8, which base.yaml renders)
    max_tokens_per_batch: int | None = None
    # forge's own: a training stream (an iterable dataset) is shuffled through a seeded buffer
    # of this many items per loader worker, saved with the checkpoint (0 or 1: no shuffling)
    stream_shuffle_buffer: int = 1000
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
    # None: on, except under fsdp (whose saves are synchronous); true / false to choose
    async_save: bool | None = None
    checkpoint_hash: str = "xxh3_128"
    early_stopping_patience: int | None = None
    early_stopping_threshold: float = 0.0
    skip_nonfinite: bool = True
    max_eval_batches: int | None = None
    # the sanity pass before training (forge/train/sanity.py); Lightning's name for its count
    sanity_check: bool = True
    num_sanity_val_steps: int = 2
    save_optimizer_state: bool = True
    save_scheduler_state: bool = True
    save_rng_state: bool = True
    save_dataloader_state: bool = True
    restore_optimizer_state: bool = True
    restore_scheduler_state: bool = True
    restore_rng_state: bool = True
    restore_dataloader_state: bool = True
    ema_decay: float | None = None
    ema_warmup_steps: int = 0
    ema_update_every: int = 1
    eval_with_ema: bool = False

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
        self._check_ema(p)
        self._check_schedule(p)
        self._check_precision(p)
        self._check_logging(p)
        self._check_evaluation(p)
        self._check_generation(p)
        self._check_saving(p)
        self._check_best_model(p)
        self._check_runtime(p)
        self._check_data(p)
        self._check_distributed(p)
        self._check_not_applicable(p)
        return p

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
