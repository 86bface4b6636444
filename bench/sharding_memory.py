"""Per-rank model state and checkpoint bytes under DDP, FSDP2 and HSDP, in one run.

Each contender is a fresh torchrun job (gloo on the CPU, nccl on GPUs) of the plain trainer on
the same Llama (``--hidden``, ``--layers``) with AdamW and a moving average of the weights
(``ema_decay``): DDP and FSDP (``full_shard``) on 2 and 4 processes, HSDP (``hybrid_shard``)
on 4 as 2 replicas x 2 shards. After the last optimizer step every rank counts the bytes it
holds of each part of the model state (its local rows of each DTensor: weights, gradients,
optimizer moments, the average), and after the checkpoint the bytes of the files it wrote of
the weights, optimizer and average. The table gives each figure per rank (the largest rank)
and its ratio to DDP's on the same process count: FSDP's should be about 1/N, HSDP's about
1/shards (its replicas hold the same rows; only the first replica writes them).

    .venv/bin/python bench/sharding_memory.py [--hidden 256 --layers 4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

#: (label, processes, trainer arguments)
CONTENDERS = [
    ("DDP", 2, {}),
    ("FSDP", 2, {"fsdp": "full_shard"}),
    ("DDP", 4, {}),
    ("FSDP", 4, {"fsdp": "full_shard"}),
    ("HSDP 2x2", 4, {"fsdp": "hybrid_shard", "fsdp_config": {"replicate_size": 2}}),
]
PARTS = ("weights", "gradients", "optimizer", "average")


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    """One rank of one contender: train 2 steps, save, write this rank's figures."""
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge.checkpoint import read_manifest
    from forge.data import CausalLMCollator
    from forge.train import Trainer, TrainerCallback, TrainingArguments
    from forge.train.ema import moving_average

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))

    class Blocks(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> dict:
            ids = torch.randint(3, 512, (32,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids.tolist()}

    found: dict[str, int] = {}

    class Count(TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            params = list(model.parameters())
            found["weights"] = local_bytes(params)
            found["gradients"] = local_bytes(p.grad for p in params if p.grad is not None)
            found["optimizer"] = local_bytes(
                t for s in optimizer.state.values() for t in s.values() if t.dim()
            )
            average = moving_average(trainer)
            found["average"] = local_bytes(average.shadow) if average else 0

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=64,
    )
    training = TrainingArguments(
        output_dir=args.output,
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        ema_decay=0.99,
        async_save=False,
        **json.loads(args.options),
    )
    trainer = Trainer(
        LlamaForCausalLM(config),
        training,
        Blocks(),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[Count()],
    )
    trainer.train()
    checkpoint = Path(args.output) / "checkpoints" / "checkpoint-000002"
    manifest = read_manifest(checkpoint)
    written = 0
    for name in ("model", "optimizer", "ema"):
        for file in manifest.components[name]["files"]:
            mine = f"-shard-{rank:05d}-" in file or ("-shard-" not in file and rank == 0)
            written += manifest.files[file]["size"] if mine else 0
    found["checkpoint"] = written
    Path(args.output, f"bytes-rank-{rank}.json").write_text(json.dumps(found))


def run(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (label, nproc, options) in enumerate(CONTENDERS):
            output = Path(scratch) / str(index)
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", __file__, "--worker", "--output", str(output),
                "--options", json.dumps(options), "--hidden", str(args.hidden),
                "--layers", str(args.layers),
            ]  # fmt: skip
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
            result = subprocess.run(command, env=env, capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(f"{label} on {nproc} failed:\n{result.stderr[-3000:]}")
            ranks = [
                json.loads((output / f"bytes-rank-{r}.json").read_text()) for r in range(nproc)
            ]
            rows.append((label, nproc, {k: max(r[k] for r in ranks) for k in ranks[0]}))
    baseline = {n: figures for label, n, figures in rows if label == "DDP"}
    print(f"Llama hidden {args.hidden}, {args.layers} layers; bytes per rank (the largest rank)")
    header = f"{'strategy':10} {'procs':>5} " + " ".join(
        f"{name:>17}" for name in (*PARTS, "model state", "checkpoint")
    )
    print(header)
    for label, nproc, figures in rows:
        figures = {**figures, "model state": sum(figures[p] for p in PARTS)}
        cells = []
        for name in (*PARTS, "model state", "checkpoint"):
            base = (
                baseline[nproc][name]
                if name != "model state"
                else sum(baseline[nproc][p] for p in PARTS)
            )
            ratio = figures[name] / base if base else 0.0
            cells.append(f"{figures[name] / 1024:9.0f}K ({ratio:4.2f})")
        print(f"{label:10} {nproc:>5} " + " ".join(f"{c:>17}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers = 64, 2
    if args.worker:
        worker(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
