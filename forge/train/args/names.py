"""The names of Hugging Face's ``TrainingArguments`` values, and what forge does with each.

The schedules, optimizers and integrations HF names, split into those forge builds and those
it refuses with a reason; the HF arguments that do not apply to forge (``NOT_APPLICABLE``).
Nothing here imports torch until a schedule's keywords are asked for.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

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
SCHEDULES_WITH_REQUIRED_KWARGS = (
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
CHECKPOINT_HASHES = ("sha256", "xxh3_128")  # forge.checkpoint.io.HASH_ALGORITHMS
SAMPLING = ("random", "sequential", "group_by_length")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
TOKEN_COUNTS = ("no", "all", "non_padding")
METRIC_INCLUDES = ("inputs", "loss")
DDP_BACKENDS = ("gloo", "nccl", "mpi", "xccl", "ccl", "hccl", "cncl", "mccl")
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")

#: HF names that do not apply to forge: the values accepted (HF's default, and any that mean
#: the same in forge) and why others are refused
#: why FSDP, DeepSpeed and other parameter or optimizer-state sharding are refused (here and by
#: the Accelerate trainer, which reads them from an accelerate config)
SHARDING_UNSUPPORTED = (
    "forge does not shard parameters or optimizer state yet with this trainer: its checkpoints "
    "hold the whole weights and optimizer state, which a sharded run would hold one shard of; "
    "shard with the plain trainer (fsdp: full_shard, under --nproc N), train with DDP or split "
    "the model with the pipeline trainer"
)

NOT_APPLICABLE: dict[str, tuple[tuple[Any, ...], str]] = {
    "optim_target_modules": (
        (None,),
        "it selects layers for GaLore/Apollo, which forge does not build",
    ),
    "use_liger_kernel": ((False,), "Liger kernels patch models; forge trains the model as given"),
    "liger_kernel_config": ((None,), "Liger kernels patch models; forge trains the model as given"),
    "neftune_noise_alpha": ((None,), "NEFTune noise is not implemented"),
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
    "deepspeed": ((None,), SHARDING_UNSUPPORTED),
    "debug": (("", None), "HF's debug options are for its TPU and underflow tools"),
    "skip_memory_metrics": ((True,), "forge does not report memory metrics"),
    "dataloader_in_order": ((True,), "exact resume needs batches in order"),
    "sortish_sampler": (
        (False,),
        "HF's Seq2SeqTrainer reads it nowhere either; train_sampling_strategy: group_by_length "
        "(or max_tokens_per_batch) batches items of similar length",
    ),
}


#: keywords every schedule function gets from the trainer, never from lr_scheduler_kwargs
_SCHEDULE_OWN = ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")


def schedule_keywords(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(keywords ``lr_scheduler_kwargs`` may give schedule ``name``, keywords it must give)."""
    import torch
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, GreedyLR, SchedulerType

    function = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    if name == "reduce_lr_on_plateau":
        function = torch.optim.lr_scheduler.ReduceLROnPlateau
    elif name == "greedy":
        function = GreedyLR
    if name == "constant":  # transformers.get_scheduler passes it nothing else
        return (), ()
    params = [
        p
        for p in inspect.signature(function).parameters.values()
        if p.name not in (*_SCHEDULE_OWN, "self") and p.kind is not p.VAR_KEYWORD
    ]
    if name == "constant_with_warmup":
        params = []
    required = tuple(p.name for p in params if p.default is p.empty)
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        required = ("min_lr|min_lr_rate",)  # one of the two
    return tuple(p.name for p in params), required
