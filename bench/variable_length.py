"""Batches of variable-length documents: padding, real-token throughput and resume cost of
forge's length-grouped batches, against Hugging Face's Trainer and against packing.

The corpus is real text no one here wrote: the Python standard library's source files (the
train split of the default project's corpus, ``forge.data.stdlib_source_files``), tokenized
with the default project's tokenizer (tiny_lm's byte-level BPE, vocab 4096, built locally by
``forge.data.load_or_train_tokenizer`` and cached in ``--cache-dir``; nothing is downloaded).
A document is, by default, one top-level ``def`` or ``class`` of a file with its decorators
(``--documents definitions``: about 5,000 documents, median about 120 tokens); ``--documents
files`` takes whole files instead (about 550, most longer than 512 tokens). Each document is
cut to ``--max-length`` tokens; the lengths are otherwise the corpus's own.

Three parts (``--parts``):

* ``padding``: the fraction of the padded tokens that are padding, over ``--epochs`` epochs of
  batches of ``--batch-size`` drawn from each order, without a model: random order with
  dynamic padding (forge's ``ResumableDistributedSampler``, what ``random`` gives), forge's
  ``LengthGroupedSampler`` (``train_sampling_strategy: group_by_length``), HF's
  ``LengthGroupedSampler`` (seeded alike), forge's ``TokenBudgetBatchSampler``
  (``max_tokens_per_batch`` = batch size x max length), and padding-free packing
  (``DataCollatorWithFlattening``: no padding by construction). Also each batch's attention
  cost: query-key pairs an eager/sdpa attention computes (padded: rows x longest^2; packed: one
  row of all tokens, its mask as long as the row) over the pairs the documents need (the sum of
  their lengths squared).
* ``throughput``: real (non-pad) tokens per second of training the same tiny Llama (random
  weights, seed 42) through ``forge.train.Trainer`` with ``train_sampling_strategy:
  group_by_length`` and ``transformers.Trainer`` with ``train_sampling_strategy=
  "group_by_length"`` (transformers 5's name for 4.x's ``group_by_length=True``), both with
  forge's ``CausalLMCollator``; HF's Trainer with its sampler's generator seeded as forge's
  (``hf-forge-order``: exactly forge's batches, nothing else changed); and forge in random
  order, padded (``CausalLMCollator``) and packed (``DataCollatorWithFlattening``). The time of steps W to W + N is taken at each
  step's end (bench/train_speed.py's clocks), and the real tokens of the forwards in that window
  are counted by a forward pre-hook on the model (``attention_mask`` summed; a packed row is all
  real). HF's own sampler draws from torch's global generator, so its batches are not forge's
  (the real tokens of each timed window are reported beside the rate). Contenders run
  interleaved, each repeat in a rotated order, after one short untimed run of each (a
  process's first training run pays warm-up costs inside its window: here 0.5-0.7x the
  later runs' rate). Reported: medians and min-max over ``--repeat`` runs, and a robust rate,
  the median of the real tokens/s of all runs' blocks of 10 steps (as bench/train_speed.py's
  robust column): a burst of load from another job spoils a block, not the result.
* ``resume``: how long forge's grouped loader takes, built afresh, to load a saved state and
  hand out its first batch, resumed at an early step vs a late step of an epoch (median over
  ``--resume-repeat`` alternating tries), and whether that batch is the one the uninterrupted
  loader gave.

torch runs one thread by default (``--threads 0``: torch's own count): on a 2-core machine
shared with other jobs, two threads per process made each step up to 10x slower here.

Targets: forge grouped / HF grouped real tokens/s >= 1.0; resume late / early <= 1.1.

    .venv/bin/python bench/variable_length.py [--documents definitions|files] [--max-length 512]
        [--batch-size 16] [--repeat 3] [--warmup 3 --steps 100] [--parts padding,throughput,resume]
        [--threads 1] [--json] [--quick] [--profile forge-grouped|hf-grouped|...]

``--json`` prints every figure as one JSON object on stdout (progress goes to stderr).
``--profile NAME`` runs one contender once more under cProfile over its timed steps.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset
from train_speed import ForgeClock, HFClock, StepClock
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM
from transformers.trainer_pt_utils import LengthGroupedSampler as HFLengthGroupedSampler

import forge.train
from forge.data import CausalLMCollator, load_or_train_tokenizer
from forge.data.corpus import stdlib_source_files
from forge.data.length_grouping import LengthGroupedSampler, TokenBudgetBatchSampler
from forge.data.loader import ResumableDistributedSampler, build_dataloader

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VOCAB_SIZE = 4096  # tiny_lm's tokenizer (projects/causal_lm.yaml's default)
#: the robust rate is the median of the real tokens/s of blocks of this many steps, pooled over
#: runs: a burst of load from another process spoils a block, not the result
BLOCK_STEPS = 10
MODEL = {"hidden_size": 64, "intermediate_size": 170, "num_hidden_layers": 2}


# ---------------------------------------------------------------------- corpus
def stdlib_documents(unit: str, max_files: int | None = None) -> list[str]:
    """The standard library's train-split sources: whole files, or each top-level ``def`` and
    ``class`` (decorators included) of each file that parses."""
    texts = [path.read_text(errors="replace") for path in stdlib_source_files("train")]
    texts = texts[:max_files] if max_files else texts
    if unit == "files":
        return [text for text in texts if text.strip()]
    documents = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a file of another Python's grammar: skipped
            continue
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                documents.append("".join(lines[first - 1 : node.end_lineno]))
    return documents


class TokenizedDocuments(Dataset):
    """Items ``{"input_ids": list[int]}``, one per document, cut to ``max_length`` tokens."""

    def __init__(self, ids: Sequence[Sequence[int]], max_length: int) -> None:
        self.ids = [list(doc[:max_length]) for doc in ids if doc]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.ids[index]}

    @property
    def lengths(self) -> list[int]:
        return [len(doc) for doc in self.ids]


def build_corpus(args: argparse.Namespace) -> TokenizedDocuments:
    tokenizer = load_or_train_tokenizer(args.cache_dir, vocab_size=VOCAB_SIZE)
    documents = stdlib_documents(args.documents, args.max_files)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()  # "longer than model_max_length": we cut
        ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return TokenizedDocuments(ids, args.max_length)


# ---------------------------------------------------------------------- padding
def chunks(order: Sequence[int], size: int) -> list[list[int]]:
    """``order`` cut into batches of ``size`` (the last may be smaller: drop_last is off)."""
    return [list(order[i : i + size]) for i in range(0, len(order), size)]


def epoch_batches(
    name: str,
    lengths: list[int],
    dataset: Dataset,
    batch: int,
    max_length: int,
    seed: int,
    epoch: int,
) -> list[list[int]]:
    """One epoch's batches (lists of item indices) as ``name``'s order forms them."""
    if name == "plain":
        sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=seed)
    elif name == "forge_grouped":
        sampler = LengthGroupedSampler(dataset, lengths, batch_size=batch, seed=seed)
    elif name == "hf_grouped":
        generator = torch.Generator().manual_seed(seed + epoch)
        return chunks(
            list(HFLengthGroupedSampler(batch, lengths=lengths, generator=generator)), batch
        )
    elif name == "forge_token_budget":
        sampler = TokenBudgetBatchSampler(
            dataset, lengths, max_tokens=batch * max_length, seed=seed
        )
        sampler.set_epoch(epoch)
        return [[int(i) for i in one] for one in sampler]
    else:
        raise ValueError(name)
    sampler.set_epoch(epoch)
    return chunks([int(i) for i in sampler], batch)


def batch_costs(batches: list[list[int]], lengths: list[int]) -> dict[str, float]:
    """Padding and attention cost of ``batches``, padded to each batch's longest item."""
    real = padded = 0
    fractions, padded_pairs, packed_pairs, needed_pairs = [], 0, 0, 0
    for one in batches:
        sizes = [lengths[i] for i in one]
        width = max(sizes)
        real += sum(sizes)
        padded += width * len(sizes)
        fractions.append(1 - sum(sizes) / (width * len(sizes)))
        padded_pairs += len(sizes) * width**2
        packed_pairs += sum(sizes) ** 2
        needed_pairs += sum(s * s for s in sizes)
    fractions.sort()
    return {
        "padding_fraction": 1 - real / padded,  # of all padded tokens
        "batch_padding_median": statistics.median(fractions),
        "batch_padding_p90": fractions[int(0.9 * (len(fractions) - 1))],
        "batches": len(batches),
        "tokens_per_batch": real / len(batches),
        "attention_pairs_padded_vs_needed": padded_pairs / needed_pairs,
        "attention_pairs_packed_vs_needed": packed_pairs / needed_pairs,
    }


def measure_padding(corpus: TokenizedDocuments, args: argparse.Namespace) -> dict[str, Any]:
    lengths = corpus.lengths
    results: dict[str, Any] = {}
    for name in ("plain", "forge_grouped", "hf_grouped", "forge_token_budget"):
        batches = [
            b
            for epoch in range(args.epochs)
            for b in epoch_batches(
                name, lengths, corpus, args.batch_size, args.max_length, args.seed, epoch
            )
        ]
        results[name] = batch_costs(batches, lengths)
    plain = results["plain"]
    results["packed"] = {  # the plain batches, each packed into one row
        "padding_fraction": 0.0,
        "batch_padding_median": 0.0,
        "batch_padding_p90": 0.0,
        "batches": plain["batches"],
        "tokens_per_batch": plain["tokens_per_batch"],
        "attention_pairs_packed_vs_needed": plain["attention_pairs_packed_vs_needed"],
    }
    forge_grouped = [
        epoch_batches(
            "forge_grouped", lengths, corpus, args.batch_size, args.max_length, args.seed, e
        )
        for e in range(args.epochs)
    ]
    hf_grouped = [
        epoch_batches("hf_grouped", lengths, corpus, args.batch_size, args.max_length, args.seed, e)
        for e in range(args.epochs)
    ]
    results["forge_order_equals_hf"] = forge_grouped == hf_grouped
    return results


# ---------------------------------------------------------------------- throughput
@dataclass(frozen=True)
class Setup:
    batch_size: int
    max_length: int
    warmup: int  # untimed steps before the window
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


class RealTokenCounter:
    """A forward pre-hook: the time and real-token count of each training forward."""

    def __init__(self) -> None:
        self.forwards: list[tuple[float, int]] = []

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        real = int(mask.sum()) if mask is not None else ids.numel()
        self.forwards.append((time.perf_counter(), real))

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.forwards if start < t < end)


def build_model(setup: Setup) -> torch.nn.Module:
    torch.manual_seed(setup.seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=setup.max_length,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="sdpa",
        **MODEL,
    )
    return LlamaForCausalLM(config)


def forge_runner(strategy: str, packed: bool) -> Callable[..., None]:
    def run(setup: Setup, dataset: Dataset, clock: StepClock, model: torch.nn.Module) -> None:
        args = forge.train.TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="forge-", dir=setup.workdir),
            max_steps=setup.total_steps,
            per_device_train_batch_size=setup.batch_size,
            train_sampling_strategy=strategy,
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
        )
        collator = DataCollatorWithFlattening() if packed else CausalLMCollator(pad_token_id=0)
        trainer = forge.train.Trainer(
            model,
            args,
            train_dataset=dataset,
            data_collator=collator,
            callbacks=[ForgeClock(clock)],
        )
        trainer.train()

    return run


class SeededHFTrainer(transformers.Trainer):
    """HF's Trainer whose ``LengthGroupedSampler`` draws from a generator seeded as forge's
    (``seed`` + epoch 0), so both trainers see the same batches; nothing else changes."""

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        sampler.generator = torch.Generator().manual_seed(self.args.seed)
        return sampler


def hf_runner(trainer_class: type[transformers.Trainer]) -> Callable[..., None]:
    def run(setup: Setup, dataset: Dataset, clock: StepClock, model: torch.nn.Module) -> None:
        run_hf_grouped(setup, dataset, clock, model, trainer_class)

    return run


def run_hf_grouped(
    setup: Setup,
    dataset: Dataset,
    clock: StepClock,
    model: torch.nn.Module,
    trainer_class: type[transformers.Trainer] = transformers.Trainer,
) -> None:
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-", dir=setup.workdir),
        max_steps=setup.total_steps,
        per_device_train_batch_size=setup.batch_size,
        train_sampling_strategy="group_by_length",  # 4.x: group_by_length=True
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
    )
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[HFClock(clock)],
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its PrinterCallback prints each log
        trainer.train()


CONTENDERS: dict[str, Callable[..., None]] = {
    "forge grouped": forge_runner("group_by_length", packed=False),
    "HF grouped": run_hf_grouped,
    "HF grouped, forge's order": hf_runner(SeededHFTrainer),
    "forge padded": forge_runner("random", packed=False),
    "forge packed": forge_runner("random", packed=True),
}
SHORT_NAMES = {
    "forge-grouped": "forge grouped",
    "hf-grouped": "HF grouped",
    "hf-forge-order": "HF grouped, forge's order",
    "forge-padded": "forge padded",
    "forge-packed": "forge packed",
}


def measure_run(
    name: str, setup: Setup, dataset: Dataset, profiler: cProfile.Profile | None = None
) -> dict[str, float]:
    """One run of a contender: real tokens/s and steps/s over its timed window."""
    gc.collect()
    clock = StepClock(setup.warmup, setup.total_steps, profiler)
    counter = RealTokenCounter()
    model = build_model(setup)
    model.register_forward_pre_hook(counter, with_kwargs=True)
    CONTENDERS[name](setup, dataset, clock, model)
    times = clock.window()
    seconds = times[-1] - times[0]
    tokens = counter.tokens_between(times[0], times[-1])
    block = min(BLOCK_STEPS, setup.steps)
    blocks = [
        counter.tokens_between(times[i], times[i + block]) / (times[i + block] - times[i])
        for i in range(0, len(times) - block, block)
    ]
    return {
        "tokens_per_s": tokens / seconds,
        "steps_per_s": setup.steps / seconds,
        "real_tokens": tokens,
        "seconds": seconds,
        "block_tokens_per_s": blocks,
    }


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def measure_throughput(
    corpus: TokenizedDocuments,
    setup: Setup,
    names: list[str],
    repeat: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    # an untimed short run of each first: the process's first training run pays warm-up costs
    # (the allocator growing, lazy imports and first calls) inside its window, which would
    # count against whichever contender happens to run first
    short = replace(setup, steps=min(setup.steps, BLOCK_STEPS))
    for name in names:
        measure_run(name, short, corpus)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(repeat):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(measure_run(name, setup, corpus))
            got = runs[name][-1]
            log(
                f"  run {r + 1}/{repeat} {name}: {got['tokens_per_s']:.0f} real tokens/s, "
                f"{got['steps_per_s']:.2f} steps/s"
            )
    return {
        name: {key: spread([run[key] for run in done]) for key in ("tokens_per_s", "steps_per_s")}
        | {
            "real_tokens": [run["real_tokens"] for run in done],
            "robust_tokens_per_s": statistics.median(
                rate for run in done for rate in run["block_tokens_per_s"]
            ),
        }
        for name, done in runs.items()
    }


def profile(name: str, setup: Setup, corpus: TokenizedDocuments, top: int) -> str:
    profiler = cProfile.Profile()
    got = measure_run(name, setup, corpus, profiler)
    out = io.StringIO()
    print(f"profile of {name!r}, timed steps only: {got['steps_per_s']:.2f} steps/s", file=out)
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(key).print_stats(top)
        body = text.getvalue()
        print(f"-- sorted by {key}\n{body[body.find('   ncalls') :].rstrip()}", file=out)
    return out.getvalue()


# ---------------------------------------------------------------------- resume
def grouped_loader(corpus: TokenizedDocuments, batch_size: int, seed: int) -> Any:
    """forge's training loader for ``group_by_length`` (as the trainer builds it)."""
    return build_dataloader(
        corpus,
        batch_size=batch_size,
        collate_fn=CausalLMCollator(pad_token_id=0),
        seed=seed,
        drop_last=False,
        lengths=corpus.lengths,
    )


def measure_resume(corpus: TokenizedDocuments, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds from a fresh grouped loader to its first batch after loading a state saved at
    an early and a late step of epoch 1 (the second epoch)."""
    loader = grouped_loader(corpus, args.batch_size, args.seed)
    epoch_steps = len(loader)
    early, late = args.early, min(args.late, epoch_steps - 1) if args.late else epoch_steps - 1
    states, expected = {}, {}
    loader.set_epoch(1)
    for step, batch in enumerate(loader, start=1):  # step = batches consumed
        if step in (early, late):
            states[step] = loader.state_dict()
        if step - 1 in (early, late):
            expected[step - 1] = batch["input_ids"]
        if step > late:
            break
    times: dict[int, list[float]] = {early: [], late: []}
    exact = True
    for r in range(args.resume_repeat):
        for at in (early, late) if r % 2 == 0 else (late, early):
            gc.collect()
            start = time.perf_counter()
            fresh = grouped_loader(corpus, args.batch_size, args.seed)
            fresh.load_state_dict(states[at])
            first = next(iter(fresh))
            times[at].append(time.perf_counter() - start)
            exact = exact and torch.equal(first["input_ids"], expected[at])
    return {
        "epoch_steps": epoch_steps,
        "early_step": early,
        "late_step": late,
        "early_s": spread(times[early]),
        "late_s": spread(times[late]),
        "late_vs_early": statistics.median(times[late]) / statistics.median(times[early]),
        "first_batch_is_the_next_one": exact,
    }


# ---------------------------------------------------------------------- report
def render(results: dict[str, Any]) -> str:
    out = io.StringIO()
    corpus, machine = results["corpus"], results["machine"]
    print(
        f"corpus: {corpus['documents']} stdlib {corpus['unit']} cut to {corpus['max_length']} "
        f"tokens (tiny_lm's BPE, vocab {VOCAB_SIZE}); lengths median {corpus['median_length']}, "
        f"mean {corpus['mean_length']:.0f}, {corpus['at_max_length']:.0%} at the cut; batch "
        f"{results['batch_size']}",
        file=out,
    )
    print(
        f"machine: {machine['cpus']} CPUs, torch {machine['torch']} ({machine['threads']} "
        f"threads), transformers {machine['transformers']}; load average "
        f"{machine['load_start']:.2f} at the start, {machine['load_end']:.2f} at the end",
        file=out,
    )
    if "padding" in results:
        pad = results["padding"]
        print(
            f"\npadding over {results['epochs']} epoch(s); attention pairs vs needed: "
            "query-key pairs of eager/sdpa attention over sum(length^2)",
            file=out,
        )
        print(
            f"{'order':22s} {'padding':>8s} {'median/batch':>13s} {'p90/batch':>10s} "
            f"{'tokens/batch':>13s} {'attention vs needed':>20s}",
            file=out,
        )
        for name in ("plain", "forge_grouped", "hf_grouped", "forge_token_budget", "packed"):
            row = pad[name]
            pairs = row.get("attention_pairs_padded_vs_needed") if name != "packed" else None
            pairs = pairs if pairs is not None else row["attention_pairs_packed_vs_needed"]
            print(
                f"{name:22s} {row['padding_fraction']:8.1%} {row['batch_padding_median']:13.1%} "
                f"{row['batch_padding_p90']:10.1%} {row['tokens_per_batch']:13.0f} "
                f"{pairs:19.2f}x",
                file=out,
            )
        print(
            f"forge's grouped order equals HF's (same seed): {pad['forge_order_equals_hf']}",
            file=out,
        )
    if "throughput" in results:
        setup = results["throughput_setup"]
        print(
            f"\nthroughput: Llama hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} "
            f"layers, sdpa; {setup['warmup']} warm-up + {setup['steps']} timed steps; median "
            f"and min-max of {setup['repeat']} runs",
            file=out,
        )
        print(
            f"{'contender':26s} {'real tokens/s':>14s} {'min-max':>16s} {'robust':>8s} "
            f"{'steps/s':>8s} {'real tokens timed':>18s}",
            file=out,
        )
        for name, row in results["throughput"].items():
            t, s = row["tokens_per_s"], row["steps_per_s"]
            print(
                f"{name:26s} {t['median']:14.0f} {t['min']:7.0f}-{t['max']:<8.0f} "
                f"{row['robust_tokens_per_s']:8.0f} {s['median']:8.2f} "
                f"{statistics.median(row['real_tokens']):18.0f}",
                file=out,
            )
    if "resume" in results:
        res = results["resume"]
        print(
            f"\nresume of the grouped loader to its first batch (epoch of "
            f"{res['epoch_steps']} steps): step {res['early_step']} "
            f"{res['early_s']['median'] * 1e3:.1f} ms ({res['early_s']['min'] * 1e3:.1f}-"
            f"{res['early_s']['max'] * 1e3:.1f}), step {res['late_step']} "
            f"{res['late_s']['median'] * 1e3:.1f} ms ({res['late_s']['min'] * 1e3:.1f}-"
            f"{res['late_s']['max'] * 1e3:.1f}); the batch is the uninterrupted run's: "
            f"{res['first_batch_is_the_next_one']}",
            file=out,
        )
    print("", file=out)
    for key, value in results["ratios"].items():
        target = TARGETS.get(key)
        verdict = ""
        if target:
            op, bound = target
            met = value >= bound if op == ">=" else value <= bound
            verdict = f"   (target {op} {bound}: {'met' if met else 'missed'})"
        print(f"{key:42s} {value:7.3f}{verdict}", file=out)
    return out.getvalue()


TARGETS = {"forge_vs_hf_grouped_tokens_per_s": (">=", 1.0), "resume_late_vs_early": ("<=", 1.1)}


def ratios_of(results: dict[str, Any]) -> dict[str, float]:
    ratios: dict[str, float] = {}
    pad = results.get("padding")
    if pad:
        ratios["padding_grouped_vs_plain"] = (
            pad["forge_grouped"]["padding_fraction"] / pad["plain"]["padding_fraction"]
        )
    throughput = results.get("throughput", {})
    rate = {name: row["tokens_per_s"]["median"] for name, row in throughput.items()}
    robust = {name: row["robust_tokens_per_s"] for name, row in throughput.items()}
    pairs = {
        "forge_vs_hf_grouped_tokens_per_s": ("forge grouped", "HF grouped"),
        "forge_vs_hf_same_batches_tokens_per_s": ("forge grouped", "HF grouped, forge's order"),
        "grouped_vs_padded_tokens_per_s": ("forge grouped", "forge padded"),
        "packed_vs_padded_tokens_per_s": ("forge packed", "forge padded"),
        "packed_vs_grouped_tokens_per_s": ("forge packed", "forge grouped"),
    }
    for key, (ours, other) in pairs.items():
        if ours in rate and other in rate:
            ratios[key] = rate[ours] / rate[other]
            ratios[f"{key}_robust"] = robust[ours] / robust[other]
    if "resume" in results:
        ratios["resume_late_vs_early"] = results["resume"]["late_vs_early"]
    return ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", choices=("definitions", "files"), default="definitions")
    parser.add_argument("--max-length", type=int, default=512, help="tokens a document keeps")
    parser.add_argument("--max-files", type=int, default=None, help="the first N stdlib files")
    parser.add_argument(
        "--cache-dir",
        default=str(REPO / "projects/tiny_lm/output"),
        help="where tiny_lm's tokenizer is (built there if missing)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--epochs", type=int, default=5, help="epochs of batches for padding")
    parser.add_argument("--parts", default="padding,throughput,resume")
    parser.add_argument(
        "--contenders",
        default=",".join(SHORT_NAMES),
        help=f"comma-separated, from {','.join(SHORT_NAMES)}",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=100, help="timed steps")
    parser.add_argument("--logging-steps", type=int, default=25)
    parser.add_argument("--early", type=int, default=2, help="the early resume's step")
    parser.add_argument("--late", type=int, default=None, help="the late step (default: last)")
    parser.add_argument("--resume-repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few files and steps")
    parser.add_argument("--profile", choices=list(SHORT_NAMES), default=None)
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_files = args.max_files or 40
        args.repeat, args.warmup, args.steps, args.epochs = 1, 2, 8, 2
        args.resume_repeat = 4
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not set(args.parts) <= {"padding", "throughput", "resume"} or not args.parts:
        parser.error("--parts: choose from padding,throughput,resume")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    if not names or not set(names) <= set(SHORT_NAMES):
        parser.error(f"--contenders: choose from {','.join(SHORT_NAMES)}")
    args.contenders = [SHORT_NAMES[n] for n in names]
    if min(args.batch_size, args.max_length, args.repeat, args.steps, args.epochs) < 1:
        parser.error("--batch-size, --max-length, --repeat, --steps and --epochs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    transformers.logging.set_verbosity_error()

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)

    load_start = os.getloadavg()[0]
    corpus = build_corpus(args)
    lengths = sorted(corpus.lengths)
    results: dict[str, Any] = {
        "corpus": {
            "unit": args.documents,
            "documents": len(corpus),
            "max_length": args.max_length,
            "median_length": statistics.median(lengths),
            "mean_length": statistics.fmean(lengths),
            "at_max_length": sum(n == args.max_length for n in lengths) / len(lengths),
        },
        "batch_size": args.batch_size,
        "epochs": args.epochs,
    }
    if "padding" in args.parts:
        log("padding: measuring")
        results["padding"] = measure_padding(corpus, args)
    profile_text = ""
    if "throughput" in args.parts or args.profile:
        with tempfile.TemporaryDirectory(prefix="forge-bench-varlen-") as workdir:
            setup = Setup(
                args.batch_size,
                args.max_length,
                args.warmup,
                args.steps,
                args.logging_steps,
                Path(workdir),
                seed=args.seed,
            )
            if "throughput" in args.parts:
                log("throughput: measuring")
                results["throughput"] = measure_throughput(
                    corpus, setup, args.contenders, args.repeat, log
                )
                results["throughput_setup"] = {
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "repeat": args.repeat,
                }
            if args.profile:
                profile_text = profile(SHORT_NAMES[args.profile], setup, corpus, args.profile_top)
    if "resume" in args.parts:
        log("resume: measuring")
        results["resume"] = measure_resume(corpus, args)
    results["machine"] = {
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
    results["ratios"] = ratios_of(results)
    if args.json:
        print(json.dumps(results))
    else:
        print(render(results), end="")
    if profile_text:
        print(profile_text, file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
