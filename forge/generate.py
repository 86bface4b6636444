"""Sampling text from a checkpoint (``forge generate``).

A forge checkpoint is a Hugging Face model directory, so this is plain transformers:
``AutoModelForCausalLM.from_pretrained`` and ``generate``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from forge.errors import RuntimeFailure

logger = logging.getLogger(__name__)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory as given, or the newest valid checkpoint of a run directory."""
    from forge.checkpoint.layout import find_latest_checkpoint, validate_checkpoint

    path = Path(path)
    if not path.exists():
        raise RuntimeFailure(f"{path}: no such checkpoint or run directory")
    if (path / "manifest.json").exists() or (path / "config.json").exists():
        problems = validate_checkpoint(path) if (path / "manifest.json").exists() else []
        if problems:
            raise RuntimeFailure(f"{path} is not a valid checkpoint:\n  " + "\n  ".join(problems))
        return path
    checkpoints_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    latest = find_latest_checkpoint(checkpoints_dir)
    if latest is None:
        raise RuntimeFailure(f"{path}: no valid checkpoint found (looked in {checkpoints_dir})")
    return latest


def generate_text(
    checkpoint: Path,
    prompt: str,
    *,
    num: int = 1,
    max_new_tokens: int = 80,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> list[str]:
    """Sample ``num`` continuations of ``prompt`` from a checkpoint's model and tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    if (
        not (checkpoint / "tokenizer.json").exists()
        and not (checkpoint / "tokenizer_config.json").exists()
    ):
        raise RuntimeFailure(
            f"{checkpoint} holds no tokenizer files; give the trainer a tokenizer to save"
        )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    model.eval()
    torch.manual_seed(seed)
    encoded = tokenizer(prompt or tokenizer.bos_token or "", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **encoded,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=top_k if temperature > 0 else None,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    return [tokenizer.decode(seq, skip_special_tokens=True) for seq in output]
