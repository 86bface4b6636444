"""A small tiny_lm (the shipped templates, shrunk with -D variables) for CLI tests."""

from __future__ import annotations

# A 512-token tokenizer and a 2-layer model on 4 standard-library files: seconds, not minutes.
SMALL_LM = {
    "vocab_size": 512,
    "block_size": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "max_files": 4,
}


def defines(values: dict) -> list[str]:
    """``-D key=value`` arguments."""
    return [arg for key, value in values.items() for arg in ("-D", f"{key}={value}")]
