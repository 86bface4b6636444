"""Pipeline throughput and checkpoint saves: the pipeline trainer on 1, 2 and 4 stages beside
the plain trainer, on the same model, data and hyper-parameters, in one run.

Each contender is a fresh job: the plain trainer in one process, the pipeline trainer under
torchrun with one process per stage (gloo on the CPU, nccl on GPUs). All train the default
project's Llama (``--hidden``, ``--layers``; 8 layers so 4 stages get 2 each) on seeded random
blocks of ``--seq-len`` token ids, batch ``--batch-size`` split into ``--microbatches``
pieces (1F1B), with AdamW and a cosine schedule. Only the steady state is timed: a callback
takes the time at the end of steps W and W + N. Then each of ``--saves`` more steps saves a
checkpoint, and every rank reports (the median over the saves) how long it spent writing its
own files (its stage's weights and optimizer state, its random and data state) and the whole
save (state dicts, writes, the commit by rank 0).

On a machine with fewer cores than processes, stages share cores, so the 2- and 4-stage
rows measure the pipeline's overheads (sends, bubbles) more than a speed-up; what a stage
writes shrinks with the number of stages either way.

A second table sets pipeline x FSDP beside pipeline x DDP: ``--stages-by-replicas`` (2x2) on
the same model and data, each stage replicated (DDP) or sharded over its replicas (FSDP2
``full_shard``): the median time of a step (the slowest rank's, over the N timed steps), its
spread (the interquartile range and the slowest step), and steps/s relative to DDP. Sharding
adds an all-gather of each block's parameters to every microbatch's forward and backward
and a reduce-scatter per batch; it buys 1/replicas of the stage's model state per rank
(bench/sharding_memory.py measures that).

    .venv/bin/python bench/pipeline_speed.py [--stages 1,2,4] [--warmup 3 --steps 20]
        [--saves 3] [--hidden 256 --layers 8] [--stages-by-replicas 2x2] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


# ---------------------------------------------------------------------------------- a worker


def worker(args: argparse.Namespace) -> None:
    """One process of one contender: train, save once, write this rank's numbers."""
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from forge.checkpoint import writer as checkpoint_writer
    from forge.data import CausalLMCollator
    from forge.train import (
        PipelineTrainer,
        PipelineTrainingArguments,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.set_num_threads(args.threads)
    written = _time_writes(checkpoint_writer.CheckpointWriter)

    class Blocks(Dataset):
        def __init__(self, n: int) -> None:
            generator = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, args.vocab, (n, args.seq_len), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict:
            return {"input_ids": self.ids[index]}

    class Clock(TrainerCallback):
        """Times the steps; asks for a save at each of the last ``--saves`` steps and times it
        (the whole save, and this rank's own file writes)."""

        def __init__(self) -> None:
            self.marks: dict[int, float] = {}
            self.saves: list[float] = []
            self.writes: list[float] = []

        def on_step_end(self, a, state, control, **kwargs):
            self.marks[state.global_step] = time.perf_counter()
            if state.global_step > timed_end:
                control.should_save = True
                written[0] = 0.0

        def on_save(self, a, state, control, **kwargs):
            self.saves.append(time.perf_counter() - self.marks[state.global_step])
            self.writes.append(written[0])

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    timed_end = args.warmup + args.steps
    total = timed_end + args.saves
    values = dict(
        output_dir=args.worker,
        max_steps=total,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=total,
        eval_strategy="no",
        save_strategy="no",  # the clock asks for the saves it times
        save_final_checkpoint=False,
        report_to=[],
    )
    clock = Clock()
    common = dict(
        train_dataset=Blocks(args.batch_size * total),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[clock],
    )
    model = functools.partial(LlamaForCausalLM, config)
    if args.kind == "plain":
        trainer = Trainer(model, TrainingArguments(**values), **common)
    else:
        values["pipeline_microbatches"] = args.microbatches
        values["pipeline_parallel_size"] = args.pipeline_size or None
        if args.fsdp:
            values.update(fsdp="full_shard", async_save=False)
        trainer = PipelineTrainer(model, PipelineTrainingArguments(**values), **common)
    trainer.train()
    topology = trainer.topology
    result = {
        "rank": topology.rank,
        "stage": topology.stage,
        "steps_per_second": args.steps / (clock.marks[timed_end] - clock.marks[args.warmup]),
        "step_seconds": [
            clock.marks[step] - clock.marks[step - 1]
            for step in range(args.warmup + 1, timed_end + 1)
        ],
        "save_seconds": statistics.median(clock.saves),
        "write_seconds": statistics.median(clock.writes),
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }
    out = Path(args.worker) / f"result-rank-{topology.rank}.json"
    out.write_text(json.dumps(result))


def _time_writes(writer_class) -> list[float]:
    """Add the time of every file a CheckpointWriter writes on this rank to the returned cell."""
    total = [0.0]
    for name in ("save_torch", "save_safetensors", "save_model", "save_json"):
        original = getattr(writer_class, name)

        def timed(self, *a, _original=original, **k):
            start = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                total[0] += time.perf_counter() - start

        setattr(writer_class, name, timed)
    return total


# ---------------------------------------------------------------------------------- the runs


def run_contender(
    args: argparse.Namespace,
    kind: str,
    stages: int,
    root: Path,
    replicas: int = 1,
    fsdp: bool = False,
) -> list[dict]:
    out = root / f"{kind}-{stages}x{replicas}{'-fsdp' if fsdp else ''}"
    out.mkdir()
    processes = stages * replicas
    worker_args = [
        str(Path(__file__)), "--worker", str(out), "--kind", kind,
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
        "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
        "--microbatches", str(args.microbatches), "--warmup", str(args.warmup),
        "--steps", str(args.steps), "--saves", str(args.saves),
        "--threads", str(args.threads), "--pipeline-size", str(stages if replicas > 1 else 0),
    ]  # fmt: skip
    if fsdp:
        worker_args.append("--fsdp")
    if kind == "plain" or processes == 1:
        command = [sys.executable, *worker_args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={processes}", *worker_args,
        ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads))
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{kind} on {stages} stage(s) x {replicas} failed:\n{done.stderr[-3000:]}"
        )
    return [json.loads(p.read_text()) for p in sorted(out.glob("result-rank-*.json"))]


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    stage_counts = [int(s) for s in args.stages.split(",")]
    print(
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch "
        f"{args.batch_size} x {args.seq_len} tokens, {args.microbatches} microbatches; "
        f"{args.steps} timed steps after {args.warmup}, {args.saves} timed saves; "
        f"{args.threads} thread(s) per process"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="forge-pipeline-bench-") as tmp:
        root = Path(tmp)
        plain = run_contender(args, "plain", 1, root)
        rows.append(("plain trainer", 1, plain))
        for stages in stage_counts:
            rows.append((f"pipeline, {stages} stage(s)", stages, run_contender(
                args, "pipeline", stages, root
            )))  # fmt: skip
    base = plain[0]["steps_per_second"]
    base_save = plain[0]["save_seconds"]
    print()
    print(f"{'contender':24s} {'steps/s':>8s} {'vs plain':>9s} {'save s':>8s} {'vs plain':>9s}  "
          "per stage: parameters held, own writes s")  # fmt: skip
    for name, _, results in rows:
        speed = min(r["steps_per_second"] for r in results)  # the pipeline moves at its slowest
        save = max(r["save_seconds"] for r in results)
        stages = "  ".join(
            f"[{r['stage']}] {r['params'] / 1e6:.2f}M {r['write_seconds']:.3f}"
            for r in sorted(results, key=lambda r: r["stage"])
        )
        print(
            f"{name:24s} {speed:8.2f} {speed / base:9.2f} {save:8.3f} {save / base_save:9.2f}  "
            f"{stages}"
        )
    if args.stages_by_replicas:
        stages, replicas = (int(n) for n in args.stages_by_replicas.split("x"))
        with tempfile.TemporaryDirectory(prefix="forge-pipeline-bench-") as tmp:
            compared = [
                (f"pipeline x DDP {stages}x{replicas}", run_contender(
                    args, "pipeline", stages, Path(tmp), replicas
                )),
                (f"pipeline x FSDP {stages}x{replicas}", run_contender(
                    args, "pipeline", stages, Path(tmp), replicas, fsdp=True
                )),
            ]  # fmt: skip
        print_sharded_table(compared)
    return 0


def print_sharded_table(compared: list[tuple[str, list[dict]]]) -> None:
    """Each contender's step time (the slowest rank's at each step): median, interquartile
    range, slowest; steps/s (1 / median) relative to the first contender."""
    print()
    print(f"{'contender':24s} {'median s':>9s} {'IQR s':>15s} {'max s':>8s} {'steps/s':>8s} "
          f"{'vs DDP':>7s}")  # fmt: skip
    base = None
    for name, results in compared:
        steps = [max(times) for times in zip(*(r["step_seconds"] for r in results), strict=True)]
        q1, median, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
        speed = 1 / median
        base = base or speed
        print(
            f"{name:24s} {median:9.3f} {q1:7.3f}-{q3:7.3f} {max(steps):8.3f} {speed:8.2f} "
            f"{speed / base:7.2f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", default="1,2,4", help="pipeline stage counts to run")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (W)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (N)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--stages-by-replicas",
        default="2x2",
        help="pipeline x FSDP against pipeline x DDP on STAGESxREPLICAS processes ('' skips it)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: small model, N=4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="pipeline", help=argparse.SUPPRESS)
    parser.add_argument("--pipeline-size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.seq_len = 64, 4, 1024, 64
        args.warmup, args.steps, args.saves = 2, 4, 1
    return args


if __name__ == "__main__":
    sys.exit(main())
