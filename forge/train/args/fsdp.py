"""Hugging Face's ``fsdp`` / ``fsdp_config`` arguments, read for FSDP2 (``fully_shard``).

Nothing here imports torch: a config's sharding settings are checked with the rest of its
arguments, before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``fsdp`` words: the sharding strategy and its options (HF's names)
STRATEGIES = {  # -> reshard_after_forward
    "full_shard": True,
    "shard_grad_op": False,
    "hybrid_shard": True,  # HSDP: sharded within a replica, replicated across them
    "hybrid_shard_zero2": False,
}
HYBRID = ("hybrid_shard", "hybrid_shard_zero2")
OPTIONS = ("offload", "auto_wrap")
REFUSED_WORDS = {
    "no_shard": "no_shard is data parallelism without sharding: leave fsdp unset (DDP)",
}
#: ``fsdp_config`` keys that apply to FSDP2 (an ``fsdp_`` prefix, as HF writes them, is dropped)
CONFIG_KEYS = (
    "version",
    "reshard_after_forward",
    "cpu_offload",
    "offload_params",
    "mixed_precision",
    "transformer_layer_cls_to_wrap",
    "modules",
    "replicate_size",
    "shard_size",
)
#: other spellings of the hybrid mesh's sizes (Accelerate's ParallelismConfig, torchtitan)
SIZE_ALIASES = {
    "dp_replicate_size": "replicate_size",
    "data_parallel_replicate_degree": "replicate_size",
    "dp_shard_size": "shard_size",
    "data_parallel_shard_degree": "shard_size",
}
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


@dataclass(frozen=True)
class FsdpSettings:
    """How ``fully_shard`` is applied: resharding after forward (``full_shard``: yes, ZeRO-3;
    ``shard_grad_op``: no, ZeRO-2), parameters offloaded to the CPU, mixed-precision dtypes
    (names of torch dtypes) and the blocks sharded one by one (module paths or class names;
    None: the model's repeated layers). ``hybrid_shard`` / ``hybrid_shard_zero2`` shard on a
    2-D mesh of ``replicate_size`` replicas x ``shard_size`` shards (None: the processes of a
    node shard, the nodes replicate: see ``hybrid_mesh``)."""

    strategy: str = "full_shard"
    reshard_after_forward: bool = True
    offload_params: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    modules: tuple[str, ...] | None = None
    replicate_size: int | None = None
    shard_size: int | None = None

    @property
    def hybrid(self) -> bool:
        return self.strategy in HYBRID

    def hybrid_mesh(self, world_size: int, local_world_size: int) -> tuple[int, int]:
        """(replicas, shards) of a hybrid strategy's mesh for ``world_size`` processes,
        ``local_world_size`` of them on each node: the sizes given, the one missing worked
        out from the other, else shards within a node and replicas across nodes. A
        ValueError says why sizes do not fit."""
        replicate, shard = self.replicate_size, self.shard_size
        if shard is None:
            shard = world_size // replicate if replicate else local_world_size
        if replicate is None:
            replicate = world_size // shard if shard else 0
        if replicate * shard != world_size:
            raise ValueError(
                f"fsdp_config.replicate_size x shard_size must be the {world_size} processes "
                f"(got {replicate} x {shard})"
            )
        return replicate, shard


def _words(value: Any) -> list[str] | None:
    if value is True:
        return ["full_shard"]
    if isinstance(value, str):
        return value.replace(",", " ").split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [w for v in value for w in v.replace(",", " ").split()]
    return None


def parse_fsdp(fsdp: Any, config: Any, key: str) -> tuple[FsdpSettings | None, list[str]]:
    """The settings ``fsdp`` and ``fsdp_config`` ask for (None: no sharding), and every
    problem found in them; ``key`` is the arguments' config key (``trainer.args``)."""
    off = fsdp in (None, "", False) or (isinstance(fsdp, (list, tuple)) and not fsdp)
    config_given = config not in (None, {})
    if off:
        if config_given:
            return None, [
                f"{key}.fsdp_config is set but {key}.fsdp is not; set fsdp: full_shard (or "
                "shard_grad_op) to shard, or remove fsdp_config"
            ]
        return None, []
    problems: list[str] = []
    words = _words(fsdp)
    if words is None:
        return None, [
            f"{key}.fsdp must be a string or list of {sorted([*STRATEGIES, *OPTIONS])} "
            f"(got {fsdp!r})"
        ]
    strategies = [w for w in words if w in STRATEGIES]
    for word in words:
        if word in REFUSED_WORDS:
            problems.append(f"{key}.fsdp: {REFUSED_WORDS[word]}")
        elif word not in STRATEGIES and word not in OPTIONS:
            problems.append(
                f"{key}.fsdp: unknown option {word!r}; use one of {', '.join(STRATEGIES)}, "
                "optionally with offload / auto_wrap"
            )
    if len(strategies) > 1:
        problems.append(f"{key}.fsdp names {strategies}; choose one of {', '.join(STRATEGIES)}")
    strategy = strategies[0] if strategies else "full_shard"
    values: dict[str, Any] = {
        "strategy": strategy,
        "reshard_after_forward": STRATEGIES[strategy],
        "offload_params": "offload" in words,
    }
    if config_given:
        problems.extend(_read_config(config, f"{key}.fsdp_config", values))
    sizes = [n for n in ("replicate_size", "shard_size") if values.get(n) is not None]
    if sizes and strategy not in HYBRID:
        problems.append(
            f"{key}.fsdp_config.{sizes[0]} sizes a hybrid mesh: set fsdp: hybrid_shard (or "
            f"hybrid_shard_zero2), or remove it ({strategy} shards over every process)"
        )
    return (None if problems else FsdpSettings(**values)), problems


def _read_config(config: Any, key: str, values: dict[str, Any]) -> list[str]:
    if not isinstance(config, dict):
        return [f"{key} must be a mapping of {list(CONFIG_KEYS)} (got {config!r})"]
    problems = []
    for raw, value in config.items():
        name = str(raw).removeprefix("fsdp_")
        name = SIZE_ALIASES.get(name, name)
        if name in ("replicate_size", "shard_size"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key}.{raw} must be a positive integer (got {value!r})")
            else:
                values[name] = value
        elif name == "version":
            if value != 2:
                problems.append(
                    f"{key}.version: forge shards with FSDP2 (torch's fully_shard); version "
                    f"{value!r} is not built. Set it to 2 or remove it"
                )
        elif name == "reshard_after_forward":
            if not isinstance(value, bool):
                problems.append(f"{key}.reshard_after_forward must be true or false")
            else:
                values["reshard_after_forward"] = value
        elif name in ("cpu_offload", "offload_params"):
            if not isinstance(value, bool):
                problems.append(f"{key}.{name} must be true or false")
            else:
                values["offload_params"] = value
        elif name == "mixed_precision":
            problems.extend(_read_precision(value, f"{key}.mixed_precision", values))
        elif name in ("transformer_layer_cls_to_wrap", "modules"):
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                problems.append(f"{key}.{name} must be a name or a list of names")
            else:
                values["modules"] = (*(values.get("modules") or ()), *names)
        else:
            problems.append(
                f"{key}.{raw} does not apply to FSDP2 (fully_shard); the keys that do: "
                f"{', '.join(CONFIG_KEYS)}"
            )
    return problems


def _read_precision(value: Any, key: str, values: dict[str, Any]) -> list[str]:
    if not isinstance(value, dict):
        return [f"{key} must be a mapping with param_dtype and/or reduce_dtype (got {value!r})"]
    problems = []
    for name, dtype in value.items():
        if name not in ("param_dtype", "reduce_dtype"):
            problems.append(f"{key}.{name}: unknown; use param_dtype and reduce_dtype")
        elif dtype is None:
            continue
        elif str(dtype).removeprefix("torch.") not in DTYPES:
            problems.append(f"{key}.{name}: {dtype!r} is not one of {sorted(DTYPES)}")
        else:
            values[name] = DTYPES[str(dtype).removeprefix("torch.")]
    return problems
