"""Training from a stream, on the standard library's sources written as jsonl or parquet shards
and read back through ``datasets`` (``streaming=True``), packed on the fly into blocks
(``forge.data.stream_parts.PackedStream``), one process:

* resume cost: the time from building a loader and loading a saved position to its first batch,
  at a late position against an early one (``--late`` and ``--early`` batches in). forge seeks
  the position (target: late / early <= 1.1); HF Trainer's way, ``accelerate``'s
  ``skip_first_batches`` over the same stream, replays every batch before it. Both printed.
* real tokens/s: a small Llama trained by forge's Trainer for ``--steps`` steps from the stream
  (one loader worker, shuffle buffer 1000) and from the same documents map-style
  (``PackedTextDataset``, tokenized before training), over the last two thirds of the steps,
  runs interleaved, the best of ``--repeat`` each (target >= 0.95).
* host memory over a long stream: the process's RSS after ``--warmup`` batches and after
  ``--long`` batches (several epochs; target end / warm-up <= 1.1).

    .venv/bin/python bench/streaming.py [--json] [--format jsonl|parquet] [--files N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCK, BATCH = 128, 16


def write_shards(folder: Path, files: list[Path], shards: int, fmt: str) -> list[str]:
    """The documents (one per source file) as ``shards`` files of rows ``{"text"}``."""
    names = []
    for shard in range(shards):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[shard::shards]]
        path = folder / f"part-{shard:03d}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts}), path)
        names.append(str(path))
    return names


def hf_stream(shards: list[str], fmt: str):
    import datasets

    builder = "json" if fmt == "jsonl" else "parquet"
    return datasets.load_dataset(builder, data_files=shards, split="train", streaming=True)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def resume_costs(stream, early: int, late: int, repeat: int) -> dict[str, Any]:
    """Seconds to the first batch after a resume at ``early`` and ``late`` batches: forge's
    (load the saved position) and HF Trainer's (skip_first_batches: replay)."""
    from accelerate.data_loader import skip_first_batches
    from torch.utils.data import DataLoader

    from forge.data import CausalLMCollator
    from forge.data.streams import ShardedStream, build_stream_loader

    collate = CausalLMCollator(pad_token_id=0)

    def loader():
        return build_stream_loader(stream, batch_size=BATCH, collate_fn=collate, seed=0)

    states = {}
    for name, count in (("early", early), ("late", late)):
        batches = iter(first := loader())
        for _ in range(count):
            next(batches)
        states[name] = first.state_dict()
    forge: dict[str, list[float]] = {"early": [], "late": []}
    replay: dict[str, list[float]] = {"early": [], "late": []}
    for _ in range(repeat):
        for name, count in (("early", early), ("late", late)):
            started = time.perf_counter()
            resumed = loader()
            resumed.load_state_dict(states[name])
            next(iter(resumed))
            forge[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            plain = DataLoader(ShardedStream(stream, seed=0), batch_size=BATCH, collate_fn=collate)
            next(iter(skip_first_batches(plain, count)))
            replay[name].append(time.perf_counter() - started)
    out: dict[str, Any] = {"early_batches": early, "late_batches": late}
    for label, times in (("forge", forge), ("hf_replay", replay)):
        early_s, late_s = min(times["early"]), min(times["late"])
        out[label] = {"early_s": early_s, "late_s": late_s, "late_over_early": late_s / early_s}
    return out


def train_tokens_per_second(dataset, steps: int, workers: int, out: Path) -> float:
    """Tokens/s of a small Llama trained for ``steps`` steps by forge's Trainer, over its last
    two thirds (the first third fills the stream's buffer, as a map-style dataset's tokenizing
    before training would)."""
    import functools

    from transformers import LlamaConfig, LlamaForCausalLM

    from forge.data import CausalLMCollator
    from forge.train import Trainer, TrainerCallback, TrainingArguments

    config = LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=BLOCK, tie_word_embeddings=True,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=BATCH,
        save_strategy="no", eval_strategy="no", report_to="none", logging_steps=steps,
        dataloader_num_workers=workers, disable_tqdm=True,
    )  # fmt: skip
    times: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times[state.global_step] = time.perf_counter()

    trainer = Trainer(
        functools.partial(LlamaForCausalLM, config),
        args,
        dataset,
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[Clock()],
    )
    trainer.train()
    warm = steps // 3  # from there on: the stream's buffer is full, the loops are warm
    return (steps - warm) * BATCH * BLOCK / (times[steps] - times[warm])


def long_stream_memory(stream, warmup: int, batches: int) -> dict[str, float]:
    from forge.data import CausalLMCollator
    from forge.data.streams import build_stream_loader

    loader = build_stream_loader(
        stream, batch_size=BATCH, collate_fn=CausalLMCollator(pad_token_id=0), seed=0
    )
    reading = iter(loader)
    for _ in range(warmup):
        next(reading)
    after_warmup = rss_mib()
    for _ in range(batches - warmup):
        next(reading)
    end = rss_mib()
    return {
        "batches": batches,
        "epochs_read": loader.position()["epoch"],
        "rss_after_warmup_mib": after_warmup,
        "rss_end_mib": end,
        "end_over_warmup": end / after_warmup,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--files", type=int, default=200, help="stdlib source files read")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--early", type=int, default=20)
    parser.add_argument("--late", type=int, default=400)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--long", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="fewer files, batches and steps")
    options = parser.parse_args()
    if options.quick:
        options.files, options.late, options.steps, options.long = 60, 200, 30, 1200

    import torch

    from forge.data import PackedTextDataset, load_or_train_tokenizer, stdlib_source_files
    from forge.data.stream_parts import PackedStream

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    files = stdlib_source_files("train", max_files=options.files)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_1_5_15": list(os.getloadavg()),
            "torch": torch.__version__,
        },
        "setup": {
            "format": options.format,
            "files": len(files),
            "shards": options.shards,
            "block_size": BLOCK,
            "batch_size": BATCH,
        },  # fmt: skip
    }
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        tokenizer = load_or_train_tokenizer(root / "tok", vocab_size=4096, max_files=60)
        shards = write_shards(root, files, options.shards, options.format)

        def stream():
            return PackedStream(hf_stream(shards, options.format), tokenizer, block_size=BLOCK)

        results["resume"] = resume_costs(stream(), options.early, options.late, options.repeat)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        mapped = PackedTextDataset(tokenizer, texts=texts, block_size=BLOCK)
        runs: dict[str, list[float]] = {"stream": [], "map": []}
        for index in range(options.repeat):
            runs["stream"].append(
                train_tokens_per_second(stream(), options.steps, 1, root / f"s{index}")
            )
            runs["map"].append(
                train_tokens_per_second(mapped, options.steps, 0, root / f"m{index}")
            )
        results["tokens_per_second"] = {
            "stream": max(runs["stream"]),
            "map": max(runs["map"]),
            "stream_over_map": max(runs["stream"]) / max(runs["map"]),
            "runs": runs,
            "steps": options.steps,
        }
        results["memory"] = long_stream_memory(stream(), options.warmup, options.long)
    results["machine"]["load_average_after"] = list(os.getloadavg())
    if options.json:
        print(json.dumps(results, indent=2))
    else:
        r, t, m = results["resume"], results["tokens_per_second"], results["memory"]
        print(
            f"resume at batch {r['late_batches']} vs {r['early_batches']}: forge "
            f"{r['forge']['late_s']:.3f}s vs {r['forge']['early_s']:.3f}s "
            f"(x{r['forge']['late_over_early']:.2f}); HF replay {r['hf_replay']['late_s']:.3f}s "
            f"vs {r['hf_replay']['early_s']:.3f}s (x{r['hf_replay']['late_over_early']:.2f})"
        )
        print(
            f"tokens/s: stream {t['stream']:.0f}, map-style {t['map']:.0f} "
            f"(x{t['stream_over_map']:.3f})"
        )
        print(
            f"RSS: {m['rss_after_warmup_mib']:.0f} MiB after warm-up, {m['rss_end_mib']:.0f} MiB "
            f"after {m['batches']} batches ({m['epochs_read']} epochs; "
            f"x{m['end_over_warmup']:.3f})"
        )
        print(f"load average {results['machine']['load_average_1_5_15']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
