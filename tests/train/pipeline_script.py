"""Train a tiny causal LM (4 layers, tied embeddings, no dropout: the Llama, or with
``"model": "gpt2"`` in JSON a GPT-2) with the pipeline or the plain trainer; run by torchrun
from test_pipeline_equivalence.py (or in-process for one rank).

    python -m torch.distributed.run --nproc_per_node=N pipeline_script.py OUT KIND [JSON]

KIND is ``pipeline`` or ``plain``; JSON holds extra training arguments. Rank 0 leaves
``OUT/metrics.jsonl`` (every step's loss); every rank leaves ``OUT/weights-rank-R.pt`` with the
weights it holds (the whole model for the plain trainer, its stage's own for the pipeline, each
stage's gathered whole when it is sharded: ``"fsdp": "full_shard"``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, TrainerCallback

from forge.data import CausalLMCollator
from forge.train import PipelineTrainer, PipelineTrainingArguments, Trainer, TrainingArguments
from tests.train.common import VOCAB, TokenDataset, tiny_llama_config

# 64 samples, 8 or 16 per optimizer step: 6 steps cross an epoch boundary.
TRAIN_SIZE = 64
STEPS = 6


def llama_init() -> functools.partial:
    config = tiny_llama_config()
    config.num_hidden_layers = 4
    config.attention_dropout = 0.0  # dropout masks would differ between the layouts
    config.tie_word_embeddings = True  # the pipeline's first and last stages share it
    return functools.partial(LlamaForCausalLM, config)


def gpt2_init() -> functools.partial:
    """GPT-2 as its class builds it (input and output embeddings tied), 4 layers, no dropout:
    its embedding is three modules (wte, wpe, drop) and its blocks take no rotary."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return functools.partial(GPT2LMHeadModel, config)


MODELS = {"llama": llama_init, "gpt2": gpt2_init}


class GatherStage(TrainerCallback):
    """At the end of training, while the process group lives, every rank of a sharded stage
    gathers the stage's own weights (a collective) into ``weights``."""

    def __init__(self) -> None:
        self.trainer: PipelineTrainer | None = None
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_end(self, args, state, control, **kwargs):
        self.weights = self.trainer.stage_state_dict()


def training_arguments(kind: str, output_dir: str | Path, **overrides: Any) -> TrainingArguments:
    """The arguments the pipeline scripts train with (``kind`` "pipeline": the pipeline
    trainer's), ``overrides`` applied."""
    values: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "max_grad_norm": 0.1,  # below every step's norm: clipping by the global norm matters
        "logging_steps": 1,
        "eval_strategy": "no",
        "report_to": "none",  # metrics.jsonl is always written
        **overrides,
    }
    return (PipelineTrainingArguments if kind == "pipeline" else TrainingArguments)(**values)


def train(
    output_dir: str | Path,
    kind: str,
    model: str = "llama",
    callbacks: list | None = None,
    **overrides: Any,
) -> Trainer:
    values = {"save_strategy": "no", "save_final_checkpoint": False, **overrides}
    args = training_arguments(kind, output_dir, **values)
    pipeline = kind == "pipeline"
    gather = GatherStage()
    trainer = (PipelineTrainer if pipeline else Trainer)(
        MODELS[model](),
        args,
        TokenDataset(TRAIN_SIZE),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[*(callbacks or []), *([gather] if pipeline else [])],
    )
    gather.trainer = trainer
    trainer.train()
    weights = gather.weights if pipeline else trainer.model.state_dict()
    rank = trainer.topology.rank
    torch.save(
        {k: v.detach().cpu() for k, v in weights.items()},
        Path(output_dir) / f"weights-rank-{rank}.pt",
    )
    return trainer


if __name__ == "__main__":
    torch.set_num_threads(1)
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    train(sys.argv[1], sys.argv[2], **extra)
