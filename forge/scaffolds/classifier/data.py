"""A synthetic classification dataset: seeded, so every run sees the same data."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

SPLIT_OFFSETS = {"train": 1, "eval": 2, "test": 3}


class SyntheticClassification(Dataset):
    """Points around ``num_classes`` random centres in ``num_features`` dimensions.

    The centres depend only on ``seed``, so the splits share them; each split draws its own
    points (``noise`` is their spread around the centre). Items are
    ``{"features": float tensor [num_features], "labels": long tensor []}``, which torch's
    default collation stacks into a batch.
    """

    def __init__(
        self,
        split: str = "train",
        num_samples: int = 2048,
        num_features: int = 16,
        num_classes: int = 4,
        noise: float = 1.0,
        seed: int = 0,
    ) -> None:
        if split not in SPLIT_OFFSETS:
            raise ValueError(f"split must be one of {', '.join(SPLIT_OFFSETS)} (got {split!r})")
        centres = torch.randn(
            num_classes, num_features, generator=torch.Generator().manual_seed(seed)
        )
        points = torch.Generator().manual_seed(seed * 1000 + SPLIT_OFFSETS[split])
        self.labels = torch.randint(num_classes, (num_samples,), generator=points)
        spread = noise * torch.randn(num_samples, num_features, generator=points)
        self.features = centres[self.labels] + spread

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[index], "labels": self.labels[index]}
