"""How ``forge predict`` generates with a checkpoint whose run evaluated by generating.

A run trained with ``predict_with_generate`` generated in its evaluations with
``generation_num_beams`` beams up to ``generation_max_length`` tokens (HF's Seq2SeqTrainer's
arguments; the rest of its generation settings are the model's ``generation_config``, which the
checkpoint holds). ``forge predict`` generates the same way unless told otherwise
(``--max-new-tokens``), reading those values from the run's ``config.yaml`` without building
anything.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 50  # tokens a generating model adds when neither flag nor run says


def run_generation_keywords(checkpoint: Path, max_new_tokens: int | None) -> dict[str, int]:
    """``generate``'s length keywords (and ``num_beams``) for ``checkpoint``:
    ``max_new_tokens`` when given, else its run's generation arguments where its evaluation
    generated, else ``DEFAULT_NEW_TOKENS`` new tokens."""
    settings = _run_generation_arguments(Path(checkpoint))
    keywords: dict[str, int] = {}
    if settings.get("generation_num_beams") is not None:
        keywords["num_beams"] = settings["generation_num_beams"]
    if max_new_tokens is not None:
        keywords["max_new_tokens"] = max_new_tokens
    elif settings.get("generation_max_length") is not None:
        keywords["max_length"] = settings["generation_max_length"]
    else:
        keywords["max_new_tokens"] = DEFAULT_NEW_TOKENS
    if settings:
        shown = ", ".join(f"{k}={v}" for k, v in keywords.items())
        logger.info("generating as the run's evaluation did (predict_with_generate): %s", shown)
    return keywords


def _run_generation_arguments(checkpoint: Path) -> dict[str, Any]:
    """The run's literal ``generation_max_length`` / ``generation_num_beams`` where its
    ``trainer.args`` set ``predict_with_generate: true``; {} otherwise (no run, other args)."""
    from forge.config import ConfigError, parse_config
    from forge.config.graph import CallNode

    run_dir = checkpoint.resolve().parent.parent
    config = run_dir / "config.yaml"
    if not (run_dir / "run.json").is_file() or not config.is_file():
        return {}
    try:
        cfg = parse_config(config.read_text(), origin=str(config))
    except (ConfigError, OSError) as exc:
        logger.debug("the run's config is not read for generation (%s)", exc)
        return {}
    trainer = cfg.targets.get("trainer")
    args = trainer.kwargs.get("args") if isinstance(trainer, CallNode) else None
    if not isinstance(args, CallNode) or args.kwargs.get("predict_with_generate") is not True:
        return {}
    names = ("generation_max_length", "generation_num_beams")
    return {
        name: args.kwargs[name]
        for name in names
        if isinstance(args.kwargs.get(name), int) and not isinstance(args.kwargs[name], bool)
    }
