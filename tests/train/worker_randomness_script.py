"""Two ranks, each with 2 loader workers drawing noise: 10 steps straight and 4 + a resume to 10,
compared bit for bit on each rank; run by torchrun from test_worker_randomness.py.

    python -m torch.distributed.run --nproc_per_node=2 worker_randomness_script.py OUTPUT_DIR
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from tests.train.common import assert_same_training
from tests.train.test_worker_randomness import train


def main(output_dir: str) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    out = Path(output_dir)
    torch.distributed.init_process_group("gloo")  # one group for the three trainings
    straight = train(out / "straight", 2, False)
    train(out / "run", 2, False, stop_at=4)
    resumed = train(out / "run", 2, False)
    assert resumed.state.resumed_from and resumed.state.global_step == 10
    assert_same_training(straight, resumed)
    print(f"rank {os.environ['RANK']}: identical after the resume", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
