"""Train the tiny Llama with DDP; run by torchrun from test_ddp.py.

    python -m torch.distributed.run --nproc_per_node=2 ddp_resume_script.py MODE OUTPUT_DIR

MODE is ``straight`` (40 steps), ``stop`` (rank 0 gets SIGTERM at the end of step 20; every
rank must save and stop at step 22: the stop is agreed in step 21's all-reduce, read a step later) or ``resume`` (continue the newest checkpoint to step 40).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch

from forge.train import TrainingInterrupted
from tests.train.common import SignalAtStep, make_args, make_trainer

# per rank: 116 samples / batch 4 = 29 micro-batches; accumulation 2 -> 15 steps per epoch
TRAIN_SIZE = 232


def main(mode: str, output_dir: str) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    args = make_args(
        output_dir,
        max_steps=40,
        gradient_accumulation_steps=2,
        warmup_steps=5,
        lr_scheduler_type="cosine",
        save_strategy="steps",
        save_steps=10,
        eval_strategy="steps",
        eval_steps=10,
        logging_steps=5,
    )
    rank = int(os.environ["RANK"])
    callbacks = [SignalAtStep(20)] if mode == "stop" and rank == 0 else []
    trainer = make_trainer(args, train_size=TRAIN_SIZE, eval_size=24, callbacks=callbacks)
    try:
        trainer.train(resume_from_checkpoint=mode == "resume")
    except TrainingInterrupted as stop:
        assert mode == "stop" and stop.signum == signal.SIGTERM and stop.step == 22, stop
        print(f"rank {rank} interrupted at step {stop.step}", flush=True)
        return 0
    assert mode != "stop", "training was not interrupted"
    assert trainer.state.global_step == 40
    print(f"rank {rank} finished at step {trainer.state.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
