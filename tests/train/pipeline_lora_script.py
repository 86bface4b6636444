"""Fine-tune a tiny Llama base with LoRA on the pipeline or the plain trainer; run by torchrun
from test_pipeline_lora.py (or in-process for one rank).

    python -m torch.distributed.run --nproc_per_node=N pipeline_lora_script.py OUT KIND BASE [JSON]

KIND is ``pipeline`` or ``plain``, BASE the base model's directory; JSON holds extra training
arguments, and ``"resume": true`` resumes the run in OUT. Rank 0 leaves ``OUT/metrics.jsonl``
(every step's loss) and the run's checkpoints.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from forge.data import CausalLMCollator
from forge.train import PipelineTrainer, Trainer
from forge.train.lora import load_base_model
from tests.train.common import TokenDataset
from tests.train.pipeline_script import training_arguments

TRAIN_SIZE = 64
STEPS = 6


def lora_config(**overrides: Any) -> LoraConfig:
    """No dropout: its masks would differ between the layouts."""
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **overrides})


def trainer(output_dir: str | Path, kind: str, base: str | Path, **overrides: Any) -> Trainer:
    args = training_arguments(kind, output_dir, save_strategy="steps", save_steps=2, **overrides)
    pipeline = kind == "pipeline"
    return (PipelineTrainer if pipeline else Trainer)(
        functools.partial(load_base_model, str(base)),
        args,
        TokenDataset(TRAIN_SIZE),
        data_collator=CausalLMCollator(pad_token_id=0),
        peft_config=lora_config(),
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    resume = extra.pop("resume", False)
    trainer(sys.argv[1], sys.argv[2], sys.argv[3], **extra).train(resume_from_checkpoint=resume)
