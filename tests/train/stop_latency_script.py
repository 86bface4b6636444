"""Rank 0 of a 2-process job gets SIGTERM at the end of step 5 (logging every 25 steps); every
rank must stop within two steps, with a checkpoint; run by torchrun from test_stop_latency.py.

    python -m torch.distributed.run --nproc_per_node=2 stop_latency_script.py TRAINER OUTPUT_DIR [own-signal]

TRAINER is ddp, fsdp, accelerate or pipeline. Each rank prints the step it stopped at.
``own-signal`` puts back the bug the ranks' vote prevents: rank 0 acts on its own signal at once
(the collectives then time out after 60 s instead of 30 min).
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from forge.data import CausalLMCollator
from forge.train import AccelTrainer, PipelineTrainer, Trainer, TrainingInterrupted
from tests.train.common import SignalAtStep, TokenDataset, make_args, tiny_llama_init

SIGNAL_AT = 5


def act_on_own_signal(trainer: Trainer) -> None:
    """Rank 0 stops at the first step boundary after its signal, without the others."""
    decide = trainer._should_stop

    def own_signal(synced: bool) -> bool:
        trainer._stop_agreed = trainer._signals.received or trainer._stop_agreed
        return decide(synced)

    trainer._should_stop = own_signal


def main(kind: str, output_dir: str, mode: str = "") -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    rank = int(os.environ["RANK"])
    args = make_args(
        output_dir,
        max_steps=40,
        logging_steps=25,
        save_steps=25,
        fsdp="full_shard" if kind == "fsdp" else "",
        per_device_train_batch_size=4,
        **({"ddp_timeout": 60} if mode == "own-signal" else {}),
    )
    trainer_cls = {"accelerate": AccelTrainer, "pipeline": PipelineTrainer}.get(kind, Trainer)
    callbacks = [SignalAtStep(SIGNAL_AT)] if rank == 0 else []
    trainer = trainer_cls(
        tiny_llama_init(),
        args,
        TokenDataset(256),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=callbacks,
    )
    if mode == "own-signal" and rank == 0:
        act_on_own_signal(trainer)
    try:
        trainer.train()
    except TrainingInterrupted as stop:
        print(f"rank {rank} stopped at step {stop.step}", flush=True)
        return 0
    print(f"rank {rank} was not stopped", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
