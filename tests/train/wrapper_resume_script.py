"""A LossAdapter model under DDP or FSDP2, 8 steps straight and 4 + a resume to 8, compared bit
for bit on every rank; run by torchrun from test_wrapper_resume.py.

    python -m torch.distributed.run --nproc_per_node=2 wrapper_resume_script.py OUTPUT_DIR ddp|fsdp
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from tests.train.common import assert_same_tensors
from tests.train.test_wrapper_resume import Net, Pairs


def train(output_dir: Path, strategy: str, stop_at: int | None = None, resume: bool = False):
    import functools

    from forge.train import LossAdapter, Trainer
    from tests.train.common import StopAtStep, make_args

    args = make_args(
        output_dir,
        max_steps=8,
        save_strategy="steps",
        save_steps=4,
        per_device_train_batch_size=4,
        fsdp="full_shard" if strategy == "fsdp" else "",
    )
    callbacks = [StopAtStep(stop_at)] if stop_at else []
    trainer = Trainer(functools.partial(LossAdapter, Net), args, Pairs(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def local(state: dict) -> dict:
    """Each rank's own rows of sharded tensors, plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def main(output_dir: str, strategy: str) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    out = Path(output_dir)
    # one process group for the three trainings (each trainer uses the one that exists)
    torch.distributed.init_process_group("gloo")
    straight = train(out / "straight", strategy)
    weights = local(straight.model.state_dict())
    train(out / "run", strategy, stop_at=4)
    resumed = train(out / "run", strategy, resume=True)
    assert resumed.state.global_step == 8 and resumed.state.resumed_from
    assert_same_tensors(weights, local(resumed.model.state_dict()), "model")
    print(f"rank {os.environ['RANK']}: identical after the resume", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
