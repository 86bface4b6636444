"""Train the tiny Llama with FSDP2 or DDP; run by torchrun from test_fsdp.py.

    python -m torch.distributed.run --nproc_per_node=N fsdp_script.py OUT MODE [STOP]

MODE ``fsdp``, ``zero2`` (shard_grad_op with activation checkpointing), ``ddp``, ``plain``
(no sharding: one process, or DDP), ``accel`` (the Accelerate trainer), ``pipeline`` (the
pipeline trainer), ``ppfsdp`` (the pipeline trainer, 2 stages each sharded over its
replicas: 4 processes are 2 stages x 2 shards) or ``ppddp`` (the same with whole replicas); ``KIND-tied`` ties the model's output head to its token embedding,
``KIND-wide`` makes it 4 times as wide, ``KIND-ema`` keeps a moving average of the weights
(``ema_decay`` 0.9; ``KIND-evalema`` evaluates with it too), ``KIND-ckpt`` checkpoints the
activations, ``KIND-compile`` compiles the model (``torch.compile``, the ``aot_eager`` backend:
traced forward and backward, no C++ toolchain) before the strategy wraps it.
Gradient accumulation and clipping are on, and an evaluation every 3 steps over an eval set the
ranks split unevenly (a sharded forward needs every rank). Saves every 3 steps; with STOP the
job is SIGKILLed by rank 0 right after the checkpoint of step STOP is committed. MODE
``KIND[-tied]-resume`` (``fsdp-resume``, ``plain-tied-resume``, ...) continues OUT's newest
checkpoint, each rank saving the weights it loaded as OUT/loaded-rank-RRRRR.pt. The last
step's checkpoint holds the final weights and optimizer state (the test reads them from there).
"""

from __future__ import annotations

import functools
import os
import signal
import sys

import torch
from transformers import LlamaForCausalLM, TrainerCallback

from forge.data import CausalLMCollator
from forge.train import (
    AccelTrainer,
    AccelTrainingArguments,
    PipelineTrainer,
    PipelineTrainingArguments,
    Trainer,
)
from tests.train.common import TokenDataset, make_args, tiny_llama_config

STEPS = 9
ACCUMULATION = 2


#: the sharded kinds: FSDP2 (ZeRO-3), and ZeRO-2 with activation checkpointing around it
SHARDING = {
    "fsdp": {"fsdp": "full_shard"},
    "zero2": {"fsdp": "shard_grad_op", "activation_checkpointing": True},
    # HSDP: 2 replicas of 2 shards on 4 processes (on two nodes of 2, the default mesh)
    "hsdp": {"fsdp": "hybrid_shard", "fsdp_config": {"replicate_size": 2}},
}

#: ``KIND-compile``: traced by dynamo and AOTAutograd, run without generated kernels
COMPILED = {"torch_compile": True, "torch_compile_backend": "aot_eager"}


class KillAfterSave(TrainerCallback):
    """SIGKILL this job (its process group) once the checkpoint of ``step`` is committed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.killpg(os.getpgid(0), signal.SIGKILL)


class RecordLoaded(TrainerCallback):
    """Before the first resumed step, every rank saves the weights its model holds (the whole
    tensor of each DTensor; a pipeline stage its own names) as ``loaded-rank-RRRRR.pt``."""

    def __init__(self, output_dir: str, rank: int) -> None:
        self.path = os.path.join(output_dir, f"loaded-rank-{rank:05d}.pt")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        from forge.wrappers import unwrap_model

        held = {}
        for name, tensor in unwrap_model(model).state_dict().items():  # every rank, same order
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            held[name] = whole.detach().cpu().clone()
        torch.save(held, self.path)


def main(output_dir: str, mode: str, stop: int | None) -> None:
    torch.set_num_threads(1)
    kind, *flags = mode.split("-")
    config = tiny_llama_config()
    config.attention_dropout = 0.0
    config.tie_word_embeddings = "tied" in flags
    if "wide" in flags:  # tensors large enough that a file's fixed cost per tensor is noise
        config.hidden_size, config.intermediate_size = 128, 256
    args = make_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION,
        learning_rate=1e-2,
        max_grad_norm=0.5,  # the tiny model's norm is above it: clipping acts every step
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=4,
        save_strategy="steps",
        save_steps=3,
        save_final_checkpoint=False,
        **{
            **SHARDING.get(kind, {}),
            **({"ema_decay": 0.9} if "ema" in flags else {}),
            **({"ema_decay": 0.9, "eval_with_ema": True} if "evalema" in flags else {}),
            **({"activation_checkpointing": True} if "ckpt" in flags else {}),
            **(COMPILED if "compile" in flags else {}),
        },
    )
    rank = int(os.environ.get("RANK", "0"))
    callbacks = [KillAfterSave(stop)] if stop and rank == 0 else []
    if "resume" in flags:
        callbacks.append(RecordLoaded(output_dir, rank))
    trainer_class = Trainer
    if kind == "pipeline":  # 2 stages of one layer each
        args = PipelineTrainingArguments(**args.to_dict())
        trainer_class = PipelineTrainer
    elif kind in ("ppfsdp", "ppddp"):
        values = {**args.to_dict(), "pipeline_parallel_size": 2}
        if kind == "ppfsdp":
            values.update(fsdp="full_shard", async_save=None)  # the default: off under fsdp
        args = PipelineTrainingArguments(**values)
        trainer_class = PipelineTrainer
    elif kind == "accel":
        args = AccelTrainingArguments(**args.to_dict())
        trainer_class = AccelTrainer
    trainer = trainer_class(
        functools.partial(LlamaForCausalLM, config),
        args,
        TokenDataset(64),
        TokenDataset(21, seed=1),  # 11 and 10 items: 3 batches on rank 0, 3 on rank 1 ...
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint="resume" in flags)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
