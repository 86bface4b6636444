"""Train the tiny Llama without dropout; run by torchrun from test_ddp_equivalence.py.

    python -m torch.distributed.run --nproc_per_node=N ddp_equivalence_script.py OUT BATCH [MODE]

MODE ``loss_func``: a compute_loss_func over ragged rows; ``transforms``: the model
checkpointed (activation checkpointing) and compiled (the eager backend) before DDP wraps it.

Also called in-process (one rank) by the test. Rank 0 leaves ``OUT/metrics.jsonl`` (the loss
of every step) and ``OUT/weights.pt`` (the final weights).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from forge.data import CausalLMCollator
from forge.train import Trainer
from tests.train.common import TokenDataset, make_args, tiny_llama_config

# 64 samples: with 16 samples per optimizer step (2 ranks x 4 x accumulation 2, or 1 rank x 8
# x 2) an epoch is 4 steps, so 6 steps cross an epoch boundary (a new permutation).
TRAIN_SIZE = 64
STEPS = 6
ACCUMULATION = 2


def train(
    output_dir: str | Path, per_device_batch: int, loss_func: bool = False, transforms: bool = False
) -> Trainer:
    """With ``loss_func``: rows of different lengths and an HF-style compute_loss_func that
    divides the step's token loss by num_items_in_batch (over both ranks). With
    ``transforms``: activation checkpointing and torch.compile (eager backend: no toolchain)."""
    config = tiny_llama_config()
    config.attention_dropout = 0.0  # dropout masks would differ between the two layouts
    args = make_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device_batch,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=1e-2,
        logging_steps=1,
        save_final_checkpoint=False,
        **(
            {"activation_checkpointing": True, "torch_compile_backend": "eager"}
            if transforms
            else {}
        ),
    )
    extra = {}
    dataset = TokenDataset(TRAIN_SIZE)
    if loss_func:
        from tests.train.test_loss_func import RaggedTokens, TokenSumLoss

        extra["compute_loss_func"] = TokenSumLoss()
        dataset = RaggedTokens(TRAIN_SIZE)
    trainer = Trainer(
        functools.partial(LlamaForCausalLM, config),
        args,
        dataset,
        data_collator=CausalLMCollator(pad_token_id=0),
        **extra,
    )
    trainer.train()
    if trainer.is_main_process:
        torch.save(trainer.model.state_dict(), Path(output_dir) / "weights.pt")
    return trainer


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode = sys.argv[3:]
    train(
        sys.argv[1],
        int(sys.argv[2]),
        loss_func=mode == ["loss_func"],
        transforms=mode == ["transforms"],
    )
