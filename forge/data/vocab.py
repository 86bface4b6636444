"""The vocabulary size of a tokenizer, for model configs (`!call:forge.data.vocab:vocab_size`)."""

from __future__ import annotations

from typing import Any

__all__ = ["vocab_size"]


def vocab_size(tokenizer: Any, multiple_of: int | None = None) -> int:
    """Token ids the model must embed: every id the tokenizer can produce, added and
    special tokens included (`len(tokenizer)` for a Hugging Face tokenizer, which
    `tokenizer.vocab_size` undercounts). `multiple_of` rounds up, e.g. to 64 for faster
    matrix multiplies on GPUs.
    """
    if multiple_of is not None and (not isinstance(multiple_of, int) or multiple_of < 1):
        raise ValueError(f"multiple_of must be a positive integer (got {multiple_of!r})")
    if hasattr(tokenizer, "get_vocab_size"):  # a `tokenizers.Tokenizer`
        size = tokenizer.get_vocab_size(with_added_tokens=True)
    elif hasattr(tokenizer, "__len__"):
        size = len(tokenizer)
    else:
        raise TypeError(
            f"vocab_size needs a Hugging Face tokenizer or a tokenizers.Tokenizer "
            f"(got {type(tokenizer).__name__})"
        )
    if multiple_of:
        size = -(-size // multiple_of) * multiple_of
    return size
