"""What ``forge train`` says about a config's training arguments before it trains: which of
``max_steps`` and ``num_train_epochs`` decides the length, and which arguments an optimizer or a
schedule given as a partial makes moot.

Hugging Face's rule decides the length: ``max_steps > 0`` overrides ``num_train_epochs``.
The library writes HF's defaults (``max_steps: -1``, ``num_train_epochs: 3.0``), so an HF
script's epoch count decides on its own. Where a config sets both, the epochs it wrote
would be silently ignored; ``length_note`` says which wins and where each was set. A value
counts as set by the config when it comes from a line outside forge's template library
(the project's templates, a ``--set``), or differs from the library's default (``-D``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge.config import LIBRARY_DIR, Config
from forge.config.graph import CallNode

HF_DEFAULTS = {"max_steps": -1, "num_train_epochs": 3.0}


def length_note(cfg: Config) -> str | None:
    """A sentence saying that max_steps overrides num_train_epochs, where each was set, or
    None unless the config itself set both (and max_steps is above 0)."""
    trainer = cfg.targets.get("trainer")
    args = trainer.kwargs.get("args") if isinstance(trainer, CallNode) else None
    if not isinstance(args, CallNode):
        return None
    steps, epochs = args.kwargs.get("max_steps"), args.kwargs.get("num_train_epochs")
    if not (_is_number(steps) and _is_number(epochs)) or steps <= 0:
        return None
    where = {name: _set_by_config(cfg, args, name) for name in HF_DEFAULTS}
    if not all(where.values()):
        return None
    return (
        f"max_steps: {steps} ({where['max_steps']}) overrides num_train_epochs: {epochs} "
        f"({where['num_train_epochs']}), as in Hugging Face's Trainer: training stops after "
        f"{steps} optimizer steps; set max_steps: -1 to train for the epochs instead"
    )


def _set_by_config(cfg: Config, args: CallNode, name: str, default: Any = None) -> str | None:
    """Where the config set argument `name` (`file:line`, `--set ...`), or None when the
    value is the library's default from the library's line."""
    loc = args.arg_locs.get(name, args.loc)
    where = cfg.location_text(loc) or "the config"
    file = cfg.problem(loc, "").file
    in_library = file is not None and Path(file).resolve().is_relative_to(LIBRARY_DIR.resolve())
    if in_library and args.kwargs[name] == HF_DEFAULTS.get(name, default):
        return None
    return where


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: the training arguments the default optimizer and schedule read, and the trainer argument
#: that replaces each group (a partial takes its own values)
MOOT = {
    "optimizer": (
        "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
        "optim_args",
    ),
    "lr_scheduler": ("lr_scheduler_type", "warmup_steps", "warmup_ratio", "lr_scheduler_kwargs"),
}  # fmt: skip


def moot_arguments(cfg: Config) -> list[tuple[str, str]]:
    """(argument, a sentence) for each training argument the config sets that changes nothing,
    because the optimizer or the schedule it reads is given as a partial (Hugging Face's
    Trainer ignores them the same way, without a word)."""
    from forge.train.args import TrainingArguments

    trainer = cfg.targets.get("trainer")
    args = trainer.kwargs.get("args") if isinstance(trainer, CallNode) else None
    if not isinstance(args, CallNode):
        return []
    defaults = {f.name: f.default for f in TrainingArguments.__dataclass_fields__.values()}
    found = []
    for role, names in MOOT.items():
        given = trainer.kwargs.get(role)
        if not isinstance(given, CallNode):
            continue
        there = cfg.location_text(trainer.arg_locs.get(role, given.loc)) or "the config"
        there = cfg.location_text(given.loc) or there
        for name in names:
            if name not in args.kwargs:
                continue
            where = _set_by_config(cfg, args, name, defaults.get(name))
            if where is None:
                continue
            found.append(
                (
                    name,
                    f"trainer.args.{name}: {args.kwargs[name]!r} ({where}) changes nothing: the "
                    f"{role.replace('_', ' ')} is {given.spec} ({there}), which takes its own "
                    "values; set them there, or drop the argument",
                )
            )
    return found
