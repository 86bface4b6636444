"""The reasoning task: sort a sequence of digits, generated on the fly.

Every item is drawn from a generator seeded by ``(seed, split, index)``, so an item is the
same whenever and wherever it is read (any worker, any rank, after a resume) and no file is
written. ``input_ids`` are the digits as drawn, ``labels`` the same digits in ascending
order: position i must find the i-th smallest digit, which takes comparing every digit with
the others, more passes for some sequences than for others.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

SPLITS = {"train": 0, "eval": 1, "test": 2}


class SortDigits(Dataset):
    """``num_samples`` sequences of ``length`` digits below ``num_digits``; items are
    ``{"input_ids": long [length], "labels": long [length]}``."""

    def __init__(
        self,
        split: str = "train",
        num_samples: int = 20000,
        length: int = 8,
        num_digits: int = 10,
        seed: int = 0,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)} (got {split!r})")
        self.split, self.num_samples = split, num_samples
        self.length, self.num_digits, self.seed = length, num_digits, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        key = (self.seed * len(SPLITS) + SPLITS[self.split]) * 1_000_003 + index
        generator = torch.Generator().manual_seed(key)
        digits = torch.randint(self.num_digits, (self.length,), generator=generator)
        return {"input_ids": digits, "labels": digits.sort().values}
