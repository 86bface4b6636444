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
