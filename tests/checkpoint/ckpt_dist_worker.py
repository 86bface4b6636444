"""Every rank writes into one checkpoint (run by torchrun from test_checkpoint_integration.py).

usage: torchrun --nproc_per_node=2 ckpt_dist_worker.py CHECKPOINTS_DIR
Rank r writes its rank state and the weights of layer r as a pipeline stage file.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from forge.checkpoint import (
    CheckpointWriter,
    capture_rng_state,
    rank_state_name,
    stage_weights_name,
)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(world_size)))
    torch.manual_seed(100 + rank)
    with CheckpointWriter(
        sys.argv[1], 12, rank=rank, world_size=world_size, barrier=dist.barrier
    ) as writer:
        stage = {f"{rank}.{k}": v for k, v in model[rank].state_dict().items()}
        writer.save_safetensors(stage_weights_name(rank, world_size), stage)
        writer.save_torch(rank_state_name(rank), {"rank": rank, "rng": capture_rng_state()})
        if rank == 0:
            writer.save_torch("training_state.pt", {"step": 12})
            writer.set_meta(epoch=1, world={"backend": "gloo"})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
