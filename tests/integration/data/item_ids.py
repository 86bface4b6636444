"""A project file for tests/integration/test_reshape_resume.py: items that carry their id, a
model that notes the ids it trains on, and a callback that writes them, step by step, to
``ids-rank-R.jsonl`` in the run directory (the ids of the sanity pass are left out); the same
items as a stream of shards (``id_stream``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from forge.data import ShardReader
from forge.train.callbacks import TrainerCallback

SEEN: list[int] = []  # ids the model trained on since the last step's end


class IdItems(Dataset):
    """``size`` items ``{"features", "labels", "item_id"}``, seeded."""

    def __init__(self, size: int = 96) -> None:
        draw = torch.Generator().manual_seed(0)
        self.features = torch.randn(size, 8, generator=draw)
        self.labels = torch.randint(4, (size,), generator=draw)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "features": self.features[index],
            "labels": self.labels[index],
            "item_id": torch.tensor(index),
        }


class IdModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, features, labels=None, item_id=None):
        if self.training and item_id is not None:
            SEEN.extend(int(i) for i in item_id)
        logits = self.head(torch.relu(self.inner(features)))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class RecordIds(TrainerCallback):
    """Appends ``{"step", "ids"}`` per optimizer step to ``ids-rank-R.jsonl``."""

    def on_register(self, args, state, control, register, **kwargs):
        self.file = Path(args.output_dir) / f"ids-rank-{kwargs['topology'].rank}.jsonl"

    def on_train_begin(self, args, state, control, **kwargs):
        SEEN.clear()

    def on_step_end(self, args, state, control, **kwargs):
        with self.file.open("a") as out:
            out.write(json.dumps({"step": state.global_step, "ids": SEEN}) + "\n")
        SEEN.clear()


def id_shard(shard: int, per_shard: int = 12):
    """``read`` of :func:`id_stream`: shard ``s`` holds IdItems ``s * per_shard`` onwards."""
    items = IdItems(96)
    for index in range(shard * per_shard, (shard + 1) * per_shard):
        yield items[index]


def id_stream(shards: int = 8) -> ShardReader:
    """IdItems' 96 items as a stream of ``shards`` shards, read by forge's ShardReader."""
    return ShardReader(list(range(shards)), id_shard)
