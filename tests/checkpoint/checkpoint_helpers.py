"""Tiny random models shared by the checkpoint tests."""

from __future__ import annotations

import torch
from torch import nn


def tiny_llama(seed: int = 0, *, tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class TinyNet(nn.Module):
    """A plain module with a tied weight and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0]))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 (its output head tied to the token embedding), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    config.bos_token_id = config.eos_token_id = 0
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def tiny_bert_classifier(seed: int = 0) -> nn.Module:
    """A 1-layer BERT sequence classifier with 3 labels, random weights."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=96,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
    )
    torch.manual_seed(seed)
    return BertForSequenceClassification(config).eval()


class LMWrapper(nn.Module):
    """A user's wrapper around a transformers model: carries its config, adds ``extra``
    weights of its own when asked (a value head)."""

    def __init__(self, inner: nn.Module, *, head: bool = False) -> None:
        super().__init__()
        self.config = inner.config
        self.lm = inner
        self.value_head = nn.Linear(inner.config.hidden_size, 1) if head else None

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def models_of_every_kind() -> dict:
    """Models nobody wrote for forge: transformers ones, a plain module, wrappers; each
    builder gives the same weights at every call."""
    return {
        "gpt2": tiny_gpt2,
        "llama": lambda: tiny_llama(0, tied=True),
        "bert_classifier": tiny_bert_classifier,
        "plain": lambda: (torch.manual_seed(0), TinyNet())[1],
        "wrapped_gpt2": lambda: LMWrapper(tiny_gpt2()),
        "wrapped_llama": lambda: LMWrapper(tiny_llama(0)),
    }
