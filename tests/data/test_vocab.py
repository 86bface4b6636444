"""forge.data.vocab.vocab_size: every id a tokenizer produces, for model configs."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from forge.data.vocab import vocab_size


@pytest.fixture
def tokenizer():
    base = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    fast = PreTrainedTokenizerFast(tokenizer_object=base)
    fast.add_special_tokens({"pad_token": "<pad>"})
    return base, fast


def test_counts_added_tokens(tokenizer):
    base, fast = tokenizer
    assert fast.vocab_size == 3  # what transformers reports leaves the added token out
    assert vocab_size(fast) == 4
    assert vocab_size(base) == 3


def test_multiple_of_rounds_up(tokenizer):
    _, fast = tokenizer
    assert vocab_size(fast, multiple_of=8) == 8
    assert vocab_size(fast, multiple_of=4) == 4
    with pytest.raises(ValueError, match="multiple_of must be a positive integer"):
        vocab_size(fast, multiple_of=0)


def test_refuses_what_is_not_a_tokenizer():
    with pytest.raises(TypeError, match="needs a Hugging Face tokenizer"):
        vocab_size(object())
