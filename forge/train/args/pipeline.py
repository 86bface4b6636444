"""What the pipeline trainer's arguments add to ``TrainingArguments``: how the model is split
into stages and which schedule runs them."""

from __future__ import annotations

from dataclasses import dataclass

from forge.train.args.training import TrainingArguments
from forge.train.args.values import as_int

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class PipelineTrainingArguments(TrainingArguments):
    """TrainingArguments plus how the model is split into pipeline stages.

    ``pipeline_parallel_size``: processes per pipeline (null: all of them); the others are
    data-parallel replicas. ``pipeline_microbatches``: pieces each loop batch is split into
    (null: one per pipeline process); ``per_device_train_batch_size`` must be a multiple.
    ``pipeline_schedule``: ``gpipe``, ``1f1b`` or ``interleaved_1f1b`` (with
    ``pipeline_stages_per_rank`` >= 2). ``pipeline_split``: the layers where the stages after
    the first begin (``[model.layers.2]``); null splits the layers evenly.
    ``pipeline_embedding`` (the modules before the layers, token embedding first),
    ``pipeline_layers``, ``pipeline_head`` (the modules after the layers) and
    ``pipeline_rotary`` name the model's parts; null takes them from the preset of the
    model's family (GPT-2, GPT-Neo, GPT-NeoX, OPT, Llama-like, Phi, BERT/RoBERTa masked LMs:
    forge/train/pipeline_models.py), and a model of no known family must name them.
    ``fsdp`` (``full_shard`` or ``shard_grad_op``) shards each stage over its replicas
    (pipeline x FSDP) instead of replicating it.
    """

    pipeline_parallel_size: int | None = None
    pipeline_microbatches: int | None = None
    pipeline_schedule: str = "1f1b"
    pipeline_stages_per_rank: int = 1
    pipeline_split: tuple[str, ...] | None = None
    pipeline_embedding: tuple[str, ...] | None = None
    pipeline_layers: str | None = None
    pipeline_head: tuple[str, ...] | None = None
    pipeline_rotary: str | None = None

    def validate(self) -> list[str]:
        p = super().validate()
        if self.pipeline_parallel_size is not None:
            self._int("pipeline_parallel_size", p, minimum=1, fix="or null for every process")
        if self.pipeline_microbatches is not None:
            self._int("pipeline_microbatches", p, minimum=1, fix="or null for one per stage")
        self._int("pipeline_stages_per_rank", p, minimum=1)
        self._choice("pipeline_schedule", SCHEDULES, p)
        for name in ("pipeline_layers", "pipeline_rotary"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                p.append(f"{self._key(name)} must be a module name or null (got {value!r})")
        self._names("pipeline_embedding", p, allow_none=True)
        self._names("pipeline_head", p, allow_none=True)
        self._names("pipeline_split", p, allow_none=True)
        self._check_sharded_stages(p)
        if self.max_tokens_per_batch is not None:
            p.append(
                f"{self._key('max_tokens_per_batch')}: the pipeline trainer splits each batch "
                "into micro-batches of a fixed shape; use per_device_train_batch_size (with "
                "train_sampling_strategy: group_by_length for less padding), or the plain trainer"
            )
        if self.auto_find_batch_size is True:
            p.append(
                f"{self._key('auto_find_batch_size')}: the pipeline trainer's micro-batches are "
                "its schedule (pipeline_microbatches per batch, sent between the stages in a "
                "fixed shape), and an out-of-memory error on one stage leaves the others waiting "
                "for its activations; set per_device_train_batch_size or pipeline_microbatches "
                "to what fits, and auto_find_batch_size: false"
            )
        self._check_pipeline_fit(p)
        for flag, fix in (("fp16", "use bf16"), ("torch_compile", "set it to false")):
            if getattr(self, flag) is True:
                p.append(f"{self._key(flag)} is not supported by the pipeline trainer; {fix}")
        return p

    def _check_sharded_stages(self, p: list[str]) -> None:
        """``fsdp`` shards each stage over its data-parallel replicas (pipeline x FSDP); what
        that composition cannot hold is refused here, with the reason."""
        settings = self.fsdp_settings()
        if settings is None:
            return
        if settings.hybrid:
            p.append(
                f"{self._key('fsdp')}: {settings.strategy} is not supported by the pipeline "
                "trainer: each stage is sharded over its data-parallel replicas on a 1-D mesh "
                "(pipeline stages x shards), and a hybrid mesh of replicas x shards inside each "
                "stage is not built; use full_shard or shard_grad_op"
            )
        if settings.modules is not None:
            p.append(
                f"{self._key('fsdp_config')}: transformer_layer_cls_to_wrap / modules are not "
                "read by the pipeline trainer: each stage shards its own layers one by one, "
                "then the rest of the stage as one unit; remove the key"
            )
        per_rank = as_int(self.pipeline_stages_per_rank)
        if per_rank is not None and per_rank > 1:
            p.append(
                f"{self._key('pipeline_stages_per_rank')} is {per_rank}: under fsdp each process "
                "shards exactly one stage (several stages per process, each its own FSDP root "
                "over the same ranks, are not supported); set pipeline_stages_per_rank: 1 and "
                "pipeline_schedule: 1f1b or gpipe, or leave fsdp unset"
            )

    def _names(self, name: str, p: list[str], *, allow_none: bool) -> None:
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, str):
            value = (value,)
        if (
            not isinstance(value, (list, tuple))
            or not value
            or not all(isinstance(v, str) and v for v in value)
        ):
            p.append(
                f"{self._key(name)} must be a list of module names"
                + (" or null" if allow_none else "")
                + f" (got {value!r})"
            )
            return
        setattr(self, name, tuple(value))

    def _check_pipeline_fit(self, p: list[str]) -> None:
        """What can be checked before the job's size is known."""
        schedule, per_rank = self.pipeline_schedule, as_int(self.pipeline_stages_per_rank)
        if schedule == "interleaved_1f1b" and per_rank == 1:
            p.append(
                f"{self._key('pipeline_schedule')} interleaved_1f1b runs several stages per "
                "process; set pipeline_stages_per_rank to 2 or more, or use 1f1b"
            )
        elif schedule in ("gpipe", "1f1b") and per_rank is not None and per_rank > 1:
            p.append(
                f"{self._key('pipeline_stages_per_rank')} is {per_rank}, which only the "
                "interleaved_1f1b schedule runs; set pipeline_schedule: interleaved_1f1b"
            )
        micro = as_int(self.pipeline_microbatches)
        if micro is None or micro < 1:
            return
        batch = as_int(self.per_device_train_batch_size)
        if batch is not None and batch >= 1 and batch % micro:
            p.append(
                f"{self._key('per_device_train_batch_size')} {batch} is not a multiple of "
                f"pipeline_microbatches {micro}; each batch is split into that many equal "
                "microbatches"
            )
        size = as_int(self.pipeline_parallel_size)
        if schedule == "1f1b" and size is not None and micro < size:
            p.append(
                f"{self._key('pipeline_microbatches')} {micro} is fewer than the "
                f"{size} pipeline stages, which 1f1b needs at least; raise it or use gpipe"
            )
