"""Train a tiny T5 (an encoder and a decoder stack of ``T5Block``) with FSDP2; run by torchrun
from test_fsdp.py.

    python -m torch.distributed.run --nproc_per_node=2 fsdp_t5_script.py OUT

Rank 0 writes OUT/sharded.json: the names of the modules that are FSDPModules once training
begins, and every warning the run raised (each one recorded, not only the first).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings

import torch
from transformers import T5Config, T5ForConditionalGeneration, TrainerCallback

from forge.data import CausalLMCollator
from forge.train import Trainer
from tests.train.common import VOCAB, TokenDataset, make_args


class RecordSharded(TrainerCallback):
    def __init__(self) -> None:
        self.sharded: list[str] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.fsdp import FSDPModule

        from forge.wrappers import unwrap_model

        modules = unwrap_model(model).named_modules()
        self.sharded = [name for name, module in modules if isinstance(module, FSDPModule)]


def main(output_dir: str) -> None:
    torch.set_num_threads(1)
    config = T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    args = make_args(output_dir, max_steps=3, logging_steps=1, fsdp="full_shard")
    record = RecordSharded()
    trainer = Trainer(
        functools.partial(T5ForConditionalGeneration, config),
        args,
        TokenDataset(24),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[record],
    )
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        found = {"sharded": record.sharded, "warnings": [str(w.message) for w in raised]}
        with open(os.path.join(output_dir, "sharded.json"), "w") as out:
            json.dump(found, out)


if __name__ == "__main__":
    main(sys.argv[1])
