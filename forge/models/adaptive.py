"""An adaptive-computation model: a recurrent block applied a data-dependent number of times.

Each sample's hidden state goes through the same stack of blocks again and again until a
learned halting signal fires (adaptive computation time, Graves 2016): after every pass a
halting unit gives a probability; a sample halts once its probabilities sum to
``1 - halt_epsilon`` (or at ``max_steps``), and its output is the probability-weighted mean of
its states, the last weighted by the remainder. The ponder cost (passes taken plus remainder)
is added to the loss with ``ponder_weight``, so the model learns to stop early where it can.

Only the samples still running go through a pass, so the number of block calls and their
batch sizes vary with the data. Activation checkpointing of the blocks (forge's
``activation_checkpointing``) still gives the gradients of the plain model: each call is
recomputed from its own saved inputs and random state, and the halting decisions, taken
outside the blocks, are never recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class RecurrentBlock(nn.Module):
    """A pre-norm transformer block (self-attention, then a GELU MLP), dropout on both."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_size: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.attn = nn.MultiheadAttention(hidden_size, num_heads, dropout=dropout, batch_first=True)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, ffn_size),
            nn.GELU(),
            nn.Linear(ffn_size, hidden_size),
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.attn_norm(hidden)
        attended, _ = self.attn(normed, normed, normed, need_weights=False)
        hidden = hidden + self.dropout(attended)
        return hidden + self.dropout(self.mlp(self.mlp_norm(hidden)))


class AdaptiveComputationModel(nn.Module):
    """A token classifier whose depth is decided per sample (see the module docstring).

    ``forward(input_ids, labels=None)``: ``input_ids`` [batch, length] < ``vocab_size``;
    ``labels`` [batch, length] < ``num_classes`` (``-100``: not scored). Returns a dict:
    ``logits`` [batch, length, num_classes]; with labels, ``loss`` (``task_loss`` +
    ``ponder_weight`` x ``ponder_cost``) and ``task_loss``; always ``ponder_cost`` (the mean
    over the batch of passes + remainder) and ``mean_steps`` (the mean passes), 0-d tensors
    that forge logs beside the loss.

    ``num_blocks`` blocks (``blocks.0`` ...) make one pass; every pass reuses them, told which
    pass it is by a learned step embedding. ``halt_bias`` starts the halting unit's bias so
    that, untrained, a sample takes about ``1 / sigmoid(halt_bias)`` passes.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        max_length: int,
        hidden_size: int = 64,
        num_heads: int = 4,
        ffn_size: int = 128,
        num_blocks: int = 2,
        max_steps: int = 8,
        dropout: float = 0.1,
        ponder_weight: float = 0.01,
        halt_bias: float = -1.0,
        halt_epsilon: float = 0.01,
    ) -> None:
        super().__init__()
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1 (got {max_steps})")
        if not 0 <= halt_epsilon < 1:
            raise ValueError(f"halt_epsilon must be in [0, 1) (got {halt_epsilon})")
        self.max_steps = max_steps
        self.ponder_weight = ponder_weight
        self.halt_epsilon = halt_epsilon
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.position = nn.Embedding(max_length, hidden_size)
        self.step_embed = nn.Embedding(max_steps, hidden_size)
        self.input_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            RecurrentBlock(hidden_size, num_heads, ffn_size, dropout) for _ in range(num_blocks)
        )
        self.halt = nn.Linear(hidden_size, 1)
        nn.init.constant_(self.halt.bias, halt_bias)
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        state = self.input_dropout(self.embed(input_ids) + self.position(positions))
        output, steps, remainder = self.ponder(state)
        logits = self.head(self.norm(output))
        ponder_cost = (steps + remainder).mean()
        result = {
            "logits": logits,
            "ponder_cost": ponder_cost.detach(),
            "mean_steps": steps.mean(),
        }
        if labels is not None:
            task_loss = F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
            )
            result["loss"] = task_loss + self.ponder_weight * ponder_cost
            result["task_loss"] = task_loss.detach()
        return result

    def ponder(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Passes over ``state`` [batch, length, hidden] until each sample halts: the weighted
        output, each sample's passes taken (float) and its remainder (differentiable)."""
        batch = state.shape[0]
        total = state.new_zeros(batch)  # halting probability spent so far
        steps = state.new_zeros(batch)
        remainder = state.new_zeros(batch)
        output = torch.zeros_like(state)
        running = torch.ones(batch, dtype=torch.bool, device=state.device)
        for step in range(self.max_steps):
            active = running.nonzero().squeeze(1)  # a host sync: the pass's batch size
            if active.numel() == 0:
                break
            hidden = state.index_select(0, active) + self.step_embed.weight[step]
            for block in self.blocks:
                hidden = block(hidden)
            state = state.index_copy(0, active, hidden)
            probability = torch.sigmoid(self.halt(hidden.mean(dim=1))).squeeze(-1)
            spent = total.index_select(0, active)
            halts = spent + probability > 1 - self.halt_epsilon
            if step == self.max_steps - 1:
                halts = torch.ones_like(halts)
            weight = torch.where(halts, 1 - spent, probability)
            output = output.index_add(0, active, weight[:, None, None] * hidden)
            total = total.index_add(0, active, weight)
            remainder = remainder.index_add(0, active, torch.where(halts, 1 - spent, 0.0))
            steps = steps.index_add(0, active, torch.ones_like(probability))
            running = running.index_copy(0, active, ~halts)
        return output, steps, remainder
