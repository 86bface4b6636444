"""A small MLP classifier: features in, class logits (and the loss, given labels) out."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLPClassifier(nn.Module):
    """``num_features`` -> ``hidden_size`` -> ``hidden_size`` -> ``num_classes``, GELU between.

    ``forward(features, labels=None)`` returns ``{"loss", "logits"}``; the loss is the
    cross-entropy with ``labels`` (None without them), which is what the trainer minimises.
    """

    def __init__(
        self, num_features: int, num_classes: int, hidden_size: int = 64, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden_size),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_size, hidden_size),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_size, num_classes),
        )

    def forward(
        self, features: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | None]:
        logits = self.net(features)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}
