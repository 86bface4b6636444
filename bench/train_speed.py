"""Training throughput: forge's Trainer against a hand-written PyTorch loop and Hugging Face's
Trainer, on the same model, data and hyper-parameters, in one run.

Contenders (all in this process, on the CPU, one at a time):

* ``raw loop``: the honest baseline. A ``DataLoader`` (shuffled, seeded) over the dataset with
  forge's ``CausalLMCollator``, fused AdamW, ``transformers.get_scheduler``, ``clip_grad_norm_``,
  ``zero_grad(set_to_none=True)``; no logging.
* ``forge``: ``forge.train.Trainer`` as a throughput run is configured (no eval, no saves),
  reporting to the progress log and ``metrics.jsonl`` every ``--logging-steps`` (always on;
  ``report_to`` none). Also measured: ``forge tensorboard`` (``report_to: tensorboard``, as
  forge's base config sets it).
* ``accelerate loop``: the raw loop with the model and optimizer through
  ``accelerator.prepare`` and ``accelerator.backward`` / ``clip_grad_norm_``: the bare
  Accelerate baseline. ``forge accel``: ``forge.train.AccelTrainer``, configured as ``forge``.
* ``HF Trainer``: ``transformers.Trainer`` with equivalent arguments (``report_to="none"``,
  no eval, no saves, ``use_cpu``, ``disable_tqdm``, the same logging steps and HF's default
  optimizer, the fused AdamW kernel that forge and the raw loop use too).
  ``HF Trainer for-loop AdamW`` (``optim="adamw_torch"``) is shown for reference.

All use AdamW (lr 1e-3, weight decay 0.01 on matrices only), a cosine schedule with 2 warm-up
steps, gradient clipping at 1.0 and seed 42. The model (``--model-size``) is the default
project's Llama, ``small`` (hidden 128, 4 layers) or ``medium`` (hidden 256, 6 layers), built
with the same seed for every contender; ``null`` is a one-parameter model with no compute,
so its ms/step is each trainer's own per-step cost (data loading and collation included).
The data are seeded random blocks of 128 token ids, in batches of 16.

Only the steady state is timed: a callback (in the raw loop, the loop itself) takes the time
at the end of every step from step W to step W + N, so start-up, warm-up and the end of
training are left out. Contenders are interleaved, each repeat in a rotated order. Reported:
the median over ``--repeat`` runs of N / (time of the window), and, as a check that is
robust to load from other processes, steps/s from the median time of the blocks of
``--logging-steps`` steps of all runs (each block holds one log, so logging is still paid).

Targets (on the medians): forge / raw loop >= 0.97, forge / HF Trainer >= 1.0 and
forge accel / accelerate loop >= 0.97.

    .venv/bin/python bench/train_speed.py [--model-size small|medium|null] [--repeat 3]
        [--warmup 5 --steps 40] [--threads N] [--contenders raw,forge,hf] [--quick]
        [--profile forge]

``--profile NAME`` runs one contender once more under cProfile, profiling only the timed
steps, and prints the functions with the most time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler
from transformers.modeling_outputs import CausalLMOutput

import forge.train
from forge.data import CausalLMCollator

MODEL_SIZES = {  # "null" is NullModel: no compute, so a trainer's own per-step cost shows
    "null": {},
    "small": {"hidden_size": 128, "intermediate_size": 341, "num_hidden_layers": 4},
    "medium": {"hidden_size": 256, "intermediate_size": 682, "num_hidden_layers": 6},
}
VOCAB_SIZE = 4096


@dataclass(frozen=True)
class Setup:
    """What every contender shares: model, data and hyper-parameters."""

    model_size: str
    batch_size: int
    seq_len: int
    warmup: int  # untimed steps before the timed window
    steps: int  # timed steps
    logging_steps: int
    workdir: Path
    seed: int = 42
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "cosine"
    lr_warmup_steps: int = 2

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


class RandomTokenBlocks(Dataset):
    """``size`` items ``{"input_ids": LongTensor[seq_len]}`` of seeded random token ids."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.blocks = torch.randint(0, vocab_size, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index]}


class StepClock:
    """Takes the time at the end of every step from ``start`` to ``end``; optionally profiles
    exactly that window."""

    def __init__(self, start: int, end: int, profiler: cProfile.Profile | None = None) -> None:
        self.start, self.end, self.profiler = start, end, profiler
        self.times: list[float] = []  # end of steps start, start + 1, ..., end

    def tick(self, step: int) -> None:
        if self.start <= step <= self.end:
            if step == self.end and self.profiler is not None:
                self.profiler.disable()
            self.times.append(time.perf_counter())
            if step == self.start and self.profiler is not None:
                self.profiler.enable()

    def window(self) -> list[float]:
        if len(self.times) != self.end - self.start + 1:
            raise RuntimeError(f"the run did not reach every step from {self.start} to {self.end}")
        return self.times

    def steps_per_second(self) -> float:
        times = self.window()
        return (self.end - self.start) / (times[-1] - times[0])


class ForgeClock(forge.train.TrainerCallback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick(state.global_step)


class HFClock(transformers.TrainerCallback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick(state.global_step)


class NullModel(nn.Module):
    """One parameter and a loss that needs no compute: a step's time is the trainer's own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, labels=None):
        return CausalLMOutput(loss=self.weight.sum())


def build_model(setup: Setup) -> nn.Module:
    torch.manual_seed(setup.seed)
    if setup.model_size == "null":
        return NullModel()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=setup.seq_len,
        attention_dropout=0.1,
        tie_word_embeddings=True,
        **MODEL_SIZES[setup.model_size],
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------- contenders
def run_raw_loop(setup: Setup, dataset: Dataset, clock: StepClock) -> None:
    model = build_model(setup)
    model.train()
    loader = DataLoader(
        dataset,
        batch_size=setup.batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=CausalLMCollator(pad_token_id=0),
        generator=torch.Generator().manual_seed(setup.seed),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(  # the same groups and kernel as forge's and HF's default
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": setup.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=setup.learning_rate,
        fused=True,
    )
    scheduler = get_scheduler(
        setup.lr_scheduler_type,
        optimizer,
        num_warmup_steps=setup.lr_warmup_steps,
        num_training_steps=setup.total_steps,
    )
    step = 0
    while step < setup.total_steps:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), setup.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            clock.tick(step)
            if step == setup.total_steps:
                break


def run_accelerate_loop(setup: Setup, dataset: Dataset, clock: StepClock) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    model = build_model(setup)
    model.train()
    loader = DataLoader(
        dataset,
        batch_size=setup.batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=CausalLMCollator(pad_token_id=0),
        generator=torch.Generator().manual_seed(setup.seed),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": setup.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=setup.learning_rate,
        fused=True,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = get_scheduler(
        setup.lr_scheduler_type,
        optimizer,
        num_warmup_steps=setup.lr_warmup_steps,
        num_training_steps=setup.total_steps,
    )
    step = 0
    try:
        while step < setup.total_steps:
            for batch in loader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), setup.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                clock.tick(step)
                if step == setup.total_steps:
                    break
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def forge_runner(
    report_to: tuple[str, ...] | None, accel: bool = False
) -> Callable[[Setup, Dataset, StepClock], None]:
    """A forge contender; ``report_to`` None keeps the default (no integration); ``accel``
    runs the Accelerate trainer."""

    def run(setup: Setup, dataset: Dataset, clock: StepClock) -> None:
        output_dir = tempfile.mkdtemp(prefix="forge-", dir=setup.workdir)
        extra = {} if report_to is None else {"report_to": report_to}
        arguments = forge.train.AccelTrainingArguments if accel else forge.train.TrainingArguments
        trainer_class = forge.train.AccelTrainer if accel else forge.train.Trainer
        args = arguments(
            output_dir=output_dir,
            max_steps=setup.total_steps,
            per_device_train_batch_size=setup.batch_size,
            learning_rate=setup.learning_rate,
            weight_decay=setup.weight_decay,
            max_grad_norm=setup.max_grad_norm,
            lr_scheduler_type=setup.lr_scheduler_type,
            warmup_steps=setup.lr_warmup_steps,
            logging_steps=setup.logging_steps,
            eval_strategy="no",
            save_strategy="no",
            save_final_checkpoint=False,
            seed=setup.seed,
            device="cpu",
            disable_tqdm=True,
            **extra,
        )
        trainer = trainer_class(
            build_model(setup),
            args,
            train_dataset=dataset,
            data_collator=CausalLMCollator(pad_token_id=0),
            callbacks=[ForgeClock(clock)],
        )
        trainer.train()

    return run


def hf_runner(optim: str | None) -> Callable[[Setup, Dataset, StepClock], None]:
    """An HF Trainer contender; ``optim`` None keeps HF's default optimizer."""

    def run(setup: Setup, dataset: Dataset, clock: StepClock) -> None:
        output_dir = tempfile.mkdtemp(prefix="hf-", dir=setup.workdir)
        extra = {} if optim is None else {"optim": optim}
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            max_steps=setup.total_steps,
            per_device_train_batch_size=setup.batch_size,
            learning_rate=setup.learning_rate,
            weight_decay=setup.weight_decay,
            max_grad_norm=setup.max_grad_norm,
            lr_scheduler_type=setup.lr_scheduler_type,
            warmup_steps=setup.lr_warmup_steps,
            logging_steps=setup.logging_steps,
            eval_strategy="no",
            save_strategy="no",
            seed=setup.seed,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            **extra,
        )
        trainer = transformers.Trainer(
            model=build_model(setup),
            args=args,
            train_dataset=dataset,
            data_collator=CausalLMCollator(pad_token_id=0),
            callbacks=[HFClock(clock)],
        )
        with contextlib.redirect_stdout(io.StringIO()):  # its PrinterCallback prints each log
            trainer.train()

    return run


CONTENDERS: dict[str, Callable[[Setup, Dataset, StepClock], None]] = {
    "raw loop": run_raw_loop,
    "forge": forge_runner(None),
    "forge tensorboard": forge_runner(("tensorboard",)),
    "accelerate loop": run_accelerate_loop,
    "forge accel": forge_runner(None, accel=True),
    "HF Trainer": hf_runner(None),
    "HF Trainer for-loop AdamW": hf_runner("adamw_torch"),
}
SHORT_NAMES = {
    "raw": "raw loop",
    "forge": "forge",
    "forge-tb": "forge tensorboard",
    "accel-loop": "accelerate loop",
    "forge-accel": "forge accel",
    "hf": "HF Trainer",
    "hf-forloop": "HF Trainer for-loop AdamW",
}


def measure(name: str, setup: Setup, dataset: Dataset) -> list[float]:
    """One run of a contender: the end time of each step of the timed window."""
    gc.collect()  # every run starts from a clean heap, whatever the previous one left
    clock = StepClock(setup.warmup, setup.total_steps)
    CONTENDERS[name](setup, dataset, clock)
    return clock.window()


def profile(name: str, setup: Setup, dataset: Dataset, top: int) -> None:
    gc.collect()
    profiler = cProfile.Profile()
    clock = StepClock(setup.warmup, setup.total_steps, profiler)
    CONTENDERS[name](setup, dataset, clock)
    print(
        f"\nprofile of {name!r}, timed steps only ({setup.steps} steps, "
        f"{1e3 / clock.steps_per_second():.1f} ms/step under the profiler)"
    )
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(key).print_stats(top)
        body = out.getvalue()
        print(f"-- sorted by {key}")
        print(body[body.find("   ncalls") :].rstrip())


# ---------------------------------------------------------------------- statistics
def run_rate(times: list[float]) -> float:
    """Steps per second over a whole timed window."""
    return (len(times) - 1) / (times[-1] - times[0])


def block_seconds(times: list[float], block: int) -> list[float]:
    """Durations of consecutive, non-overlapping blocks of ``block`` steps."""
    return [times[i + block] - times[i] for i in range(0, len(times) - block, block)]


@dataclass
class Summary:
    """A contender's results: ``median`` of the runs' steps/s (the headline), and ``robust``,
    steps/s from the median duration of blocks of ``logging_steps`` steps pooled over runs."""

    runs: list[float]
    median: float
    robust: float

    @classmethod
    def of(cls, windows: list[list[float]], block: int) -> Summary:
        runs = [run_rate(times) for times in windows]
        blocks = [s for times in windows for s in block_seconds(times, block)]
        return cls(runs, statistics.median(runs), block / statistics.median(blocks))


# ---------------------------------------------------------------------- report
def print_report(
    setup: Setup, summaries: dict[str, Summary], repeat: int, block: int, load: float
) -> None:
    params = sum(p.numel() for p in build_model(setup).parameters())
    model = "null model" if setup.model_size == "null" else f"{setup.model_size} Llama"
    count = f"{params / 1e6:.2f}M" if params >= 10_000 else f"{params}"
    print(
        f"model: {model}, {count} parameters; batch {setup.batch_size} x "
        f"{setup.seq_len} tokens; {setup.warmup} warm-up + {setup.steps} timed steps, median of "
        f"{repeat} runs; logging every {setup.logging_steps} steps; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs"
    )
    print(
        f"robust: steps/s from the median time of the {block}-step blocks of all runs "
        "(a burst of load from another process spoils a block, not the result)"
    )
    raw = summaries.get("raw loop")
    print(
        f"{'contender':24s} {'ms/step':>8s} {'steps/s':>8s} {'tokens/s':>9s} {'vs raw':>7s} "
        f"{'robust':>8s} {'vs raw':>7s}   runs (steps/s)"
    )
    for name, s in summaries.items():
        vs_raw = f"{s.median / raw.median:7.3f}" if raw else f"{'-':>7s}"
        robust_vs_raw = f"{s.robust / raw.robust:7.3f}" if raw else f"{'-':>7s}"
        each = " ".join(f"{v:.4g}" for v in s.runs)
        print(
            f"{name:24s} {1e3 / s.median:8.3f} {s.median:8.4g} "
            f"{s.median * setup.tokens_per_step:9.0f} {vs_raw} {s.robust:8.4g} {robust_vs_raw}"
            f"   {each}"
        )
    forge_s, hf = summaries.get("forge"), summaries.get("HF Trainer")
    forge_accel, accel_loop = summaries.get("forge accel"), summaries.get("accelerate loop")
    if setup.model_size == "null":  # no compute: the targets mean nothing, the costs do
        for name, s in summaries.items():
            if raw and name != "raw loop":
                extra = 1e3 / s.median - 1e3 / raw.median
                print(f"{name}: {extra:+.3f} ms per step beyond the raw loop's own")
    else:
        pairs = (
            ("forge", forge_s, "raw loop", raw, 0.97),
            ("forge", forge_s, "HF Trainer", hf, 1.0),
            ("forge accel", forge_accel, "accelerate loop", accel_loop, 0.97),
            ("forge accel", forge_accel, "forge", forge_s, None),
        )
        for name, ours, label, other, target in pairs:
            if ours and other:
                ratio, robust = ours.median / other.median, ours.robust / other.robust
                verdict = (
                    ""
                    if target is None
                    else (f" (target >= {target:g}): {'meets' if ratio >= target else 'misses'}")
                )
                print(f"{name} / {label} = {ratio:.3f}{verdict}   [robust: {robust:.3f}]")
    spread = max(max(s.runs) / min(s.runs) for s in summaries.values()) - 1
    if spread > 0.1:
        print(
            f"note: the runs of one contender differ by up to {spread:.0%}: other processes "
            "share the CPU, so compare the robust column, or rerun on a quiet machine "
            "(--threads 1 suffers less from sharing)"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-size", choices=list(MODEL_SIZES), default="small")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (W; 5, null: 20)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (N; 40, null: 2000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contender (R)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--contenders",
        default=",".join(SHORT_NAMES),
        help=f"comma-separated, from {','.join(SHORT_NAMES)}",
    )
    parser.add_argument("--quick", action="store_true", help="W=3, N=20, R=1: a smoke run")
    parser.add_argument("--profile", choices=list(SHORT_NAMES), default=None)
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args(argv)
    null = args.model_size == "null"
    if args.quick:
        args.warmup, args.steps, args.repeat = 3, 500 if null else 20, 1
    if args.warmup is None:
        args.warmup = 20 if null else 5
    if args.steps is None:
        args.steps = 2000 if null else 40
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHORT_NAMES]
    if unknown or not names:
        parser.error(f"--contenders: unknown {unknown}; choose from {','.join(SHORT_NAMES)}")
    if min(args.warmup, args.steps, args.repeat, args.logging_steps) < 1:
        parser.error("--warmup, --steps, --repeat and --logging-steps must be positive")
    args.contenders = [SHORT_NAMES[n] for n in names]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)  # e.g. pin_memory without a GPU
    transformers.logging.set_verbosity_error()
    # blocks of logging_steps hold one log each, so the robust rate still pays for logging
    block = args.logging_steps if args.steps >= args.logging_steps else args.steps
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="forge-bench-") as workdir:
        setup = Setup(
            model_size=args.model_size,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            warmup=args.warmup,
            steps=args.steps,
            logging_steps=args.logging_steps,
            workdir=Path(workdir),
        )
        # one epoch covers the run, so no contender pays for an epoch boundary
        size = max(4096, setup.batch_size * setup.total_steps)
        dataset = RandomTokenBlocks(size, setup.seq_len, VOCAB_SIZE, setup.seed)
        windows: dict[str, list[list[float]]] = {name: [] for name in args.contenders}
        for r in range(args.repeat):
            shift = r % len(args.contenders)
            for name in args.contenders[shift:] + args.contenders[:shift]:
                windows[name].append(measure(name, setup, dataset))
                rate = run_rate(windows[name][-1])
                print(f"  run {r + 1}/{args.repeat} {name}: {rate:.2f} steps/s", file=sys.stderr)
        summaries = {name: Summary.of(w, block) for name, w in windows.items()}
        print_report(setup, summaries, args.repeat, block, load)
        if args.profile:
            profile(SHORT_NAMES[args.profile], setup, dataset, args.profile_top)


if __name__ == "__main__":
    main()
