"""The checks of the arguments around the steps: logging and reporting, evaluation,
checkpoints and the best model, runtime and devices, data loading, distributed settings, and
the HF arguments that do not apply (``TrainingArguments.validate`` runs them with the others)."""

from __future__ import annotations

from dataclasses import fields
from os import PathLike

from forge.extras import install_command, is_installed
from forge.train.args.fsdp import FsdpSettings, parse_fsdp
from forge.train.args.names import (
    CHECKPOINT_HASHES,
    DDP_BACKENDS,
    DEVICE_PATTERN,
    INTEGRATIONS,
    LOG_LEVELS,
    METRIC_INCLUDES,
    METRIC_SCHEDULERS,
    NOT_APPLICABLE,
    OTHER_HF_INTEGRATIONS,
    SAMPLING,
    SAVE_STRATEGIES,
    STRATEGIES,
    TOKEN_COUNTS,
)
from forge.train.args.values import ValueChecks, as_float, not_multiple, quoted


class RunChecks(ValueChecks):
    """``_check_*`` methods of ``TrainingArguments`` for everything around the steps."""

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
                    f"{quoted(INTEGRATIONS)}, or add your own TrainerCallback to callbacks"
                )
            elif name not in INTEGRATIONS:
                p.append(
                    f"{key} has an unknown integration {name!r}; choose from "
                    f'{quoted(INTEGRATIONS)}, "all" or "none"'
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
            "eval_on_save",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "batch_eval_metrics",
        ):
            self._bool(name, p)
        if self.eval_on_save is True and self.eval_strategy == "no":
            p.append(
                f'{self._key("eval_on_save")} evaluates at every save, but eval_strategy is "no" '
                '(no evaluation at all); set eval_strategy: "steps" or "epoch", or unset it'
            )
        self._optional_int("eval_accumulation_steps", p, minimum=1, fix="use null to keep all")
        self._optional_int("max_eval_batches", p, minimum=1, fix="use null for the whole set")
        self._bool("sanity_check", p)
        self._int("num_sanity_val_steps", p, minimum=0, fix="or 0 for no evaluation batches")
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

    def _check_generation(self, p: list[str]) -> None:
        """HF's ``Seq2SeqTrainingArguments``: the generation settings of evaluation."""
        self._bool("predict_with_generate", p)
        self._optional_int("generation_max_length", p, minimum=1, fix="or null for the model's")
        self._optional_int("generation_num_beams", p, minimum=1, fix="or null for the model's")
        value = self.generation_config
        is_config = callable(getattr(value, "to_dict", None)) and hasattr(value, "max_length")
        if not (value is None or isinstance(value, (str, dict)) or is_config):
            p.append(
                f"{self._key('generation_config')} must be a directory or generation_config.json "
                "file, a mapping of generation settings, a transformers GenerationConfig or null "
                f"(got {value!r})"
            )
        elif isinstance(value, str) and not value:
            p.append(f"{self._key('generation_config')} must not be empty; use null for none")

    def _check_saving(self, p: list[str]) -> None:
        self._choice("save_strategy", SAVE_STRATEGIES, p)
        self._choice("checkpoint_hash", CHECKPOINT_HASHES, p)
        if self.save_strategy == "steps":
            self._interval("save_steps", p, 'set it or use save_strategy: "no"')
        self._optional_int("save_total_limit", p, minimum=1, fix="use null to keep all")
        self._int("save_top_k", p, 1, fix="1 keeps the best checkpoint only")
        for name in (
            "save_final_checkpoint",
            "save_only_model",
            "enable_jit_checkpoint",
        ):
            self._bool(name, p)
        if self.async_save is not None:  # None: the default, settled with the parallelism
            self._bool("async_save", p)
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
        top_k = self.save_top_k
        if isinstance(top_k, int) and top_k > 1 and metric is None:
            p.append(
                f"{self._key('save_top_k')} is {top_k}, but no metric ranks the checkpoints: "
                "set metric_for_best_model (e.g. eval_loss) and an eval_strategy"
            )
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
                save, every = as_float(self.save_steps), as_float(self.eval_steps)
                if save and every and not_multiple(save, every):
                    p.append(
                        f"{self._key('save_steps')} must be a multiple of eval_steps when "
                        f"load_best_model_at_end is set (got {self.save_steps} and "
                        f"{self.eval_steps}); make every checkpoint step an evaluation step"
                    )

    def _check_runtime(self, p: list[str]) -> None:
        self._int("seed", p, minimum=0)
        self._optional_int("data_seed", p, minimum=0, fix="use null to reuse seed")
        for name in (
            "full_determinism",
            "use_cpu",
            "do_train",
            "do_eval",
            "do_predict",
            "auto_find_batch_size",
        ):
            self._bool(name, p)
        if not isinstance(self.device, str) or not DEVICE_PATTERN.match(self.device):
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
        self._check_length_grouping(p)

    def _check_length_grouping(self, p: list[str]) -> None:
        """group_by_length (HF 4.x's flag or HF 5's strategy) and max_tokens_per_batch."""
        self._choice("train_sampling_strategy", SAMPLING, p)
        self._bool("group_by_length", p)
        if self.group_by_length is True:
            if self.train_sampling_strategy == "sequential":
                p.append(
                    f"{self._key('group_by_length')} is true but train_sampling_strategy is "
                    '"sequential"; set one of them'
                )
            elif self.train_sampling_strategy == "random":
                self.train_sampling_strategy = "group_by_length"
        column = self.length_column_name
        if not (isinstance(column, str) and column):
            p.append(
                f"{self._key('length_column_name')} must be a column name such as "
                f'"length" (got {column!r})'
            )
        self._optional_int(
            "max_tokens_per_batch", p, minimum=1, fix="or null for batches of a fixed size"
        )
        self._int("stream_shuffle_buffer", p, minimum=0, fix="0 reads a stream in its order")
        if self.max_tokens_per_batch is not None and self.train_sampling_strategy == "sequential":
            p.append(
                f"{self._key('max_tokens_per_batch')} forms batches of items of similar length, "
                'which is no sequential order; use train_sampling_strategy: "random" or '
                '"group_by_length", or remove max_tokens_per_batch'
            )

    def _check_distributed(self, p: list[str]) -> None:
        if self.ddp_backend is not None:
            self._choice("ddp_backend", DDP_BACKENDS, p, fix="or null to pick by device")
        for name in ("ddp_find_unused_parameters", "ddp_broadcast_buffers", "ddp_static_graph"):
            self._optional_bool(name, p)
        self._optional_int("ddp_bucket_cap_mb", p, minimum=1, fix="or null for torch's default")
        self._int("ddp_timeout", p, minimum=1)
        sharded, problems = parse_fsdp(self.fsdp, self.fsdp_config, self.config_key)
        p.extend(problems)
        if getattr(self, "async_save", False) is None:  # the default: on where it can be
            self.async_save = sharded is None
        if sharded is not None and getattr(self, "async_save", False) is True:
            p.append(
                f"{self._key('async_save')}: saves under fsdp are synchronous for now (the "
                "background commit's deferred copies do not handle sharded DTensor state); "
                "set async_save: false, or train with DDP (fsdp: null)"
            )

    def fsdp_settings(self) -> FsdpSettings | None:
        """What ``fsdp`` / ``fsdp_config`` ask of FSDP2; None when sharding is off."""
        return parse_fsdp(self.fsdp, self.fsdp_config, self.config_key)[0]

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
