"""Two ranks whose metrics fail at the step-6 evaluation, on both ranks or on rank 1 only; run
by torchrun from test_failure_checkpoint.py.

    python -m torch.distributed.run --nproc_per_node=2 failure_checkpoint_script.py OUT both|one
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from tests.train.common import make_trainer
from tests.train.test_failure_checkpoint import Failing, args_for


def main(output_dir: str, failing: str) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO)
    rank = int(os.environ["RANK"])
    fails = failing == "both" or rank == 1
    metrics = Failing(6 if fails else None)
    trainer = make_trainer(
        args_for(Path(output_dir)), eval_size=8, compute_metrics=metrics, train_size=96
    )
    metrics.trainer = trainer
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
