"""Every rank writes into one checkpoint (run by torchrun from test_checkpoint_integration.py).

usage: torchrun --nproc_per_node=2 ckpt_dist_worker.py CHECKPOINTS_DIR
Each rank is one pipeline stage: it writes the weights of layer r as its stage shard and its
own random state; rank 0 also writes a shared component. All through the registry.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from forge.checkpoint import (
    CheckpointRegistry,
    CheckpointWriter,
    Component,
    ModelWeights,
    RngState,
    Scope,
)
from forge.train.topology import Topology


class Progress:
    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    topology = Topology(rank, world_size, rank, num_stages=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(world_size)))
    torch.manual_seed(100 + rank)

    def stage_state() -> dict:
        return {f"{rank}.{k}": v for k, v in model[rank].state_dict().items()}

    registry = CheckpointRegistry(topology)
    registry.extend(
        [
            Component(
                "model", ModelWeights(model, state_fn=stage_state), Scope.STAGE, weights=True
            ),
            Component("progress", Progress(12)),
            Component("rng", RngState(), Scope.RANK, restore_last=True),
        ]
    )
    with CheckpointWriter(
        sys.argv[1], 12, rank=rank, world_size=world_size, barrier=dist.barrier
    ) as writer:
        registry.save(writer)
        if rank == 0:
            writer.set_meta(epoch=1, world={"backend": "gloo"})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
