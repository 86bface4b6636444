"""Checkpoint speed, as a user meets it: forge's saves against the disk and against its peers.

For Llama-style models of about 1M, 100M and 500M parameters with AdamW state, on one
directory, each save timed in this process (median of ``--repeat``, the spread beside it):

* forge's synchronous save (snapshot + commit, as the trainer calls it: safetensors weights,
  optimizer and RNG state, fsync, hashes, manifest, rename), with the default hash (xxh3_128)
  and with sha256;
* the same bytes written raw with fsync (the disk's own speed for this checkpoint);
* ``torch.save`` of the same state, with and without fsync;
* Hugging Face ``Trainer._save_checkpoint`` and Accelerate ``save_state`` of the same model
  and optimizer (neither fsyncs nor hashes);
* the time the loop stands still for an async save: the snapshot and starting the commit,
  then the next optimizer step's wait for the copies deferred to the commit thread (after one
  forward and backward of a 64-token sequence, whose own time is listed, not counted);

then, through the real CLI on tiny_lm (as shipped, on 24 files of its corpus): steps/s with an
async save every 10 steps against no saves, and the time of `forge resume` to its first step
from an early and from a late checkpoint of one epoch.

    .venv/bin/python bench/checkpoint.py [--sizes 1M,100M,500M] [--repeat 3] [--json]

Prints a table of ratios and writes it (and the raw times) to bench/results/; ``--json``
prints one JSON object of the ratios named by the targets, each at the largest size measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forge.checkpoint import (
    CheckpointRegistry,
    CheckpointWriter,
    Component,
    ModelWeights,
    OptimizerState,
    RngState,
    Scope,
)
from forge.checkpoint.background import BackgroundCommit
from forge.checkpoint.io import DEFAULT_HASH
from forge.checkpoint.snapshot import HostCopier, stepped_by
from forge.train.topology import Topology

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CHUNK = 1 << 20

# name: (hidden, layers, intermediate, vocab); parameters printed as measured
SIZES = {
    "1M": (96, 3, 256, 4096),
    "100M": (768, 12, 2048, 8192),
    "500M": (1536, 16, 4096, 16384),
}
# tiny_lm as shipped (its model, batch and block size) on part of its corpus, so the tokenizer
# and token caches build quickly and one epoch still holds --late steps
TINY_LM = ["-D", "max_files=24", "-D", "report_to=none", "-D", "eval_steps=100000"]


def build_state(size: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    hidden, layers, intermediate, vocab = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # materialise Adam's two moments per parameter
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def registry_for(model, optimizer) -> CheckpointRegistry:
    registry = CheckpointRegistry(Topology())
    registry.register(Component("model", ModelWeights(model), Scope.STAGE, weights=True))
    registry.register(Component("optimizer", OptimizerState(model, optimizer), Scope.STAGE))
    registry.register(Component("rng", RngState(), Scope.RANK, restore_last=True))
    return registry


def forge_sync(registry, root: Path, step: int, algorithm: str) -> float:
    start = time.perf_counter()
    snapshot = registry.snapshot(step, HostCopier(copy_cpu=False))  # as the trainer's sync save
    with CheckpointWriter(root, step, hash_algorithm=algorithm) as writer:
        snapshot.write(writer)
    return time.perf_counter() - start


def forge_async_blocked(model, optimizer, registry, root: Path, step: int, algorithm: str):
    """What the loop waits for, as the trainer's async save: the snapshot (the parameters' and
    moments' copies deferred to the commit thread) and starting the commit; then, after the
    next step's forward and backward (one sequence of 64 tokens, not counted), the optimizer
    step's wait for those copies. Returns (blocked s, forward and backward s)."""
    commits = BackgroundCommit()
    copier = HostCopier(deferrable=stepped_by(optimizer))
    start = time.perf_counter()
    snapshot = registry.snapshot(step, copier)

    def commit() -> None:
        copier.copy_deferred()
        with CheckpointWriter(root, step, hash_algorithm=algorithm) as writer:
            snapshot.write(writer)

    commits.submit(commit)
    blocked = time.perf_counter() - start
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    computed = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    gate = time.perf_counter()
    copier.wait_copied()
    blocked += time.perf_counter() - gate
    model.zero_grad(set_to_none=True)
    commits.wait()
    return blocked, gate - computed


def state_tensors(model, optimizer) -> list[list[torch.Tensor]]:
    """The tensors a checkpoint holds, one list per file (weights, optimizer state)."""
    moments = [t for state in optimizer.state.values() for t in state.values()]
    return [list(model.state_dict().values()), [t for t in moments if t.dim() > 0]]


def raw_write(groups: list[list[torch.Tensor]], extra: int, root: Path) -> float:
    """The checkpoint's bytes written raw with fsync: every tensor's memory as it is (no
    copy, so the 500M state fits twice in memory), plus ``extra`` bytes of headers and small
    files, one file per group, in 1 MiB writes as ``dd bs=1M`` does."""
    start = time.perf_counter()
    for index, group in enumerate([*groups, [torch.zeros(extra, dtype=torch.uint8)]]):
        with open(root / f"raw-{index}.bin", "wb", buffering=0) as handle:
            for tensor in group:
                view = memoryview(tensor.detach().contiguous().view(torch.uint8).numpy())
                for offset in range(0, len(view), CHUNK):
                    handle.write(view[offset : offset + CHUNK])
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def torch_save(model, optimizer, path: Path, fsync: bool) -> float:
    start = time.perf_counter()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with open(path, "wb") as handle:
        torch.save(state, handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def hf_trainer_setup(model, optimizer, root: Path) -> Any:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its shard bar would interleave with the table

    args = TrainingArguments(output_dir=str(root / "hf"), report_to=[])
    trainer = Trainer(model=model, args=args)
    trainer.args.disable_tqdm = True
    trainer.optimizer = optimizer
    trainer.create_scheduler(num_training_steps=100, optimizer=optimizer)
    return trainer


def hf_trainer_save(trainer, step: int) -> float:
    trainer.state.global_step = step
    start = time.perf_counter()
    trainer._save_checkpoint(trainer.model, trial=None)
    return time.perf_counter() - start


def accelerate_setup(model, optimizer) -> Any:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, optimizer)
    return accelerator


def accelerate_save(accelerator, directory: Path) -> float:
    start = time.perf_counter()
    accelerator.save_state(str(directory))
    return time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def measure_size(size: str, repeat: int, workdir: Path, log) -> dict[str, Any]:
    model, optimizer = build_state(size)
    params = sum(p.numel() for p in model.parameters())
    registry = registry_for(model, optimizer)
    root = Path(tempfile.mkdtemp(prefix=f"ckpt-{size}-", dir=workdir))
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "forge_sync",
            "forge_sync_sha256",
            "raw_fsync",
            "torch_save",
            "torch_save_fsync",
            "hf_trainer",
            "accelerate",
            "async_blocked",
            "next_forward_backward",
        )
    }
    nbytes = 0
    hf = accel = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hf = hf_trainer_setup(model, optimizer, root)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            log(f"  HF Trainer unavailable: {exc}")
        try:
            accel = accelerate_setup(model, optimizer)
        except Exception as exc:
            log(f"  Accelerate unavailable: {exc}")
        forge_sync(registry, root, 1, DEFAULT_HASH)  # warm-up: first imports, allocations
        shutil.rmtree(root / "checkpoint-000001")
        for round_ in range(1, repeat + 1):
            step = round_ * 10
            # every contender starts with no dirty pages, so none pays another's writeback
            os.sync()
            times["forge_sync"].append(forge_sync(registry, root, step, DEFAULT_HASH))
            checkpoint = root / f"checkpoint-{step:06d}"
            nbytes = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
            shutil.rmtree(checkpoint)
            os.sync()
            groups = state_tensors(model, optimizer)
            extra = max(nbytes - sum(t.numel() * t.element_size() for g in groups for t in g), 0)
            times["raw_fsync"].append(raw_write(groups, extra, root))
            del groups
            for path in root.glob("raw-*.bin"):
                path.unlink()
            os.sync()
            times["forge_sync_sha256"].append(forge_sync(registry, root, step, "sha256"))
            shutil.rmtree(checkpoint)
            os.sync()
            blocked, computing = forge_async_blocked(
                model, optimizer, registry, root, step, DEFAULT_HASH
            )
            times["async_blocked"].append(blocked)
            times["next_forward_backward"].append(computing)
            shutil.rmtree(checkpoint)
            gc.collect()
            for fsync in (False, True):
                os.sync()
                key = "torch_save_fsync" if fsync else "torch_save"
                times[key].append(torch_save(model, optimizer, root / "t.pt", fsync))
                (root / "t.pt").unlink()
            if hf is not None:
                os.sync()
                times["hf_trainer"].append(hf_trainer_save(hf, step))
                shutil.rmtree(root / "hf", ignore_errors=True)
            if accel is not None:
                os.sync()
                times["accelerate"].append(accelerate_save(accel, root / "accel"))
                shutil.rmtree(root / "accel", ignore_errors=True)
            log(
                f"  {size} round {round_}: "
                + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v)
            )
    shutil.rmtree(root, ignore_errors=True)
    del registry, model, optimizer, hf, accel
    gc.collect()
    return {
        "params": params,
        "bytes": nbytes,
        "times": {k: summary(v) for k, v in times.items() if v},
    }


# ---------------------------------------------------------------------------- through the CLI


def forge_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "forge.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def _run_dir(result: subprocess.CompletedProcess) -> Path:
    if result.returncode != 0:
        raise RuntimeError(f"forge failed ({result.returncode}): {result.stderr[-2000:]}")
    return Path(result.stdout.splitlines()[0])


def steps_per_second(project: Path, steps: int, saves: bool) -> float:
    settings = [*TINY_LM, "-D", f"max_steps={steps}", "-D", "logging_steps=50"]
    settings += ["--set", "trainer.args.save_final_checkpoint=false"]
    if saves:
        settings += ["-D", "save_steps=10", "--set", "trainer.args.async_save=true"]
    else:
        settings += ["--set", 'trainer.args.save_strategy="no"']
    run_dir = _run_dir(forge_cli("train", "-p", str(project), *settings, cwd=project))
    record = json.loads((run_dir / "run.json").read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return float(record["train_summary"]["train_steps_per_second"])


def resume_seconds(project: Path, run_dir: Path, step: int) -> float:
    """Wall time of `forge resume` from the step-``step`` checkpoint through one step."""
    settings = ["--set", f"trainer.args.max_steps={step + 1}"]
    settings += ["--set", 'trainer.args.save_strategy="no"']
    settings += ["--set", "trainer.args.save_final_checkpoint=false"]
    start = time.perf_counter()
    result = forge_cli(
        "resume", "-p", str(project), "--run-dir", str(run_dir), *settings, cwd=project
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0 or not re.search(rf"resumed from \S+ at step {step}", result.stderr):
        raise RuntimeError(f"resume failed ({result.returncode}): {result.stderr[-2000:]}")
    return seconds


def grad_accum(log: str) -> int:
    found = re.search(r"x accumulation (\d+)", log)
    return int(found.group(1)) if found else 1


def measure_cli(repeat: int, steps: int, late: int, workdir: Path, log) -> dict[str, Any]:
    project = workdir / "tiny_lm"
    shutil.copytree(REPO / "projects" / "tiny_lm", project, ignore=shutil.ignore_patterns("output"))
    with_saves, without = [], []
    for round_ in range(repeat):  # interleaved, so drift on a shared machine hits both alike
        without.append(steps_per_second(project, steps, saves=False))
        with_saves.append(steps_per_second(project, steps, saves=True))
        log(f"  tiny_lm round {round_ + 1}: {without[-1]} steps/s, {with_saves[-1]} with saves")
    runs = {}
    for step in (10, late):
        settings = [*TINY_LM, "-D", f"max_steps={step}", "-D", f"save_steps={step}"]
        result = forge_cli("train", "-p", str(project), *settings, cwd=project)
        runs[step] = _run_dir(result)
        epoch = re.search(r"\((\d+) epochs? of (\d+) batches per rank\)", result.stderr)
        if epoch and step == late and late * grad_accum(result.stderr) >= int(epoch.group(2)):
            log(f"  warning: step {late} is not inside the first epoch ({epoch.group(0)})")
    early, late_s = [], []
    for round_ in range(repeat):
        early.append(resume_seconds(project, runs[10], 10))
        late_s.append(resume_seconds(project, runs[late], late))
        log(f"  resume round {round_ + 1}: step 10 {early[-1]:.2f}s, step {late} {late_s[-1]:.2f}s")
    return {
        "steps": steps,
        "late_step": late,
        "steps_per_second_no_saves": summary(without),
        "steps_per_second_async_saves": summary(with_saves),
        "resume_early_s": summary(early),
        "resume_late_s": summary(late_s),
    }


# ---------------------------------------------------------------------------- ratios


def ratios_of(size: dict[str, Any]) -> dict[str, float]:
    t = {k: v["median"] for k, v in size["times"].items()}
    found = {
        "save_vs_raw": t["forge_sync"] / t["raw_fsync"],
        "save_vs_torch_save_fsync": t["forge_sync"] / t["torch_save_fsync"],
        "save_sha256_vs_raw": t["forge_sync_sha256"] / t["raw_fsync"],
        "save_sha256_vs_torch_save_fsync": t["forge_sync_sha256"] / t["torch_save_fsync"],
        "async_block_vs_sync": t["async_blocked"] / t["forge_sync"],
    }
    if "hf_trainer" in t:
        found["blocked_vs_hf_trainer"] = t["async_blocked"] / t["hf_trainer"]
    if "accelerate" in t:
        found["blocked_vs_accelerate"] = t["async_blocked"] / t["accelerate"]
    return found


TARGETS = {
    "save_vs_raw": ("<=", 1.25),
    "save_vs_torch_save_fsync": ("<=", 1.0),
    "blocked_vs_hf_trainer": ("<=", 0.5),
    "blocked_vs_accelerate": ("<=", 0.5),
    "async_block_vs_sync": ("<=", 0.10),
    "steps_with_saves_vs_none": (">=", 0.95),
    "resume_late_vs_early": ("<=", 1.1),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1M,100M,500M", help=f"from {','.join(SIZES)}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="tiny_lm steps for steps/s")
    parser.add_argument("--late", type=int, default=200, help="the late resume's step")
    parser.add_argument("--no-cli", action="store_true", help="skip the tiny_lm measurements")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the target ratios as JSON")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown}; choose from {','.join(SIZES)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-ckpt-", dir=args.dir))
    results: dict[str, Any] = {"sizes": {}, "machine": machine()}
    try:
        for size in sizes:
            log(f"{size}: measuring")
            results["sizes"][size] = measure_size(size, args.repeat, workdir, log)
        if not args.no_cli:
            log("tiny_lm through the CLI: measuring")
            results["cli"] = measure_cli(args.repeat, args.steps, args.late, workdir, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    table = {size: ratios_of(r) for size, r in results["sizes"].items()}
    largest = table[sizes[-1]]
    targets = {k: v for k, v in largest.items() if k in TARGETS}
    if "cli" in results:
        cli = results["cli"]
        targets["steps_with_saves_vs_none"] = (
            cli["steps_per_second_async_saves"]["median"]
            / cli["steps_per_second_no_saves"]["median"]
        )
        targets["resume_late_vs_early"] = (
            cli["resume_late_s"]["median"] / cli["resume_early_s"]["median"]
        )
    results["ratios"], results["targets"] = table, targets
    text = render(results, table, targets)
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"checkpoint-{stamp}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"checkpoint-{stamp}.txt").write_text(text)
    if args.json:
        print(json.dumps(targets))
    else:
        print(text, end="")
        print(f"written to {out}/checkpoint-{stamp}.{{txt,json}}")
    return 0


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": sys.platform}


def render(results: dict[str, Any], table: dict, targets: dict) -> str:
    lines = []
    for size, r in results["sizes"].items():
        lines.append(
            f"{size}: {r['params'] / 1e6:.1f}M parameters, checkpoint {r['bytes'] / 2**20:.1f} MiB"
        )
        lines.append(f"  {'save':22s} {'median s':>9s} {'min':>7s} {'max':>7s} {'MiB/s':>7s}")
        for name, t in r["times"].items():
            rate = r["bytes"] / 2**20 / t["median"] if t["median"] else 0.0
            lines.append(
                f"  {name:22s} {t['median']:9.3f} {t['min']:7.3f} {t['max']:7.3f} {rate:7.0f}"
            )
        lines.append("  " + ", ".join(f"{k} {v:.3f}" for k, v in table[size].items()))
    if "cli" in results:
        cli = results["cli"]
        lines.append(
            f"tiny_lm: {cli['steps_per_second_no_saves']['median']:.2f} steps/s without saves, "
            f"{cli['steps_per_second_async_saves']['median']:.2f} with an async save every 10; "
            f"resume to the first step {cli['resume_early_s']['median']:.2f}s from step 10, "
            f"{cli['resume_late_s']['median']:.2f}s from step {cli['late_step']}"
        )
    lines.append("targets (largest size):")
    for name, value in targets.items():
        op, bound = TARGETS[name]
        met = value <= bound if op == "<=" else value >= bound
        lines.append(
            f"  {name:28s} {value:7.3f}  target {op} {bound}  {'met' if met else 'MISSED'}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
