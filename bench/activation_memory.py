"""Peak memory and step time with and without activation checkpointing, for the default
project's model (tiny_lm's Llama) and the adaptive-computation model (projects/reasoning).

Each variant (model x checkpointing off/on) runs ``--repeat`` times, every run in a fresh
process: on CPU the peak resident set size is a process-lifetime maximum, so two variants
can never share a process. Runs are interleaved (off, on, off, on, ...). A run builds the
model with one seed, wraps its blocks through forge's transform stage
(``apply_activation_checkpointing``: Hugging Face's switch for the Llama, forge's own
non-reentrant wrapping for the adaptive model's blocks), gives AdamW its state with one
zero-gradient step, notes the memory in use (the baseline), then times ``--warmup`` +
``--steps`` training steps (forward, backward, clip, AdamW) on seeded random batches.

Memory is what forge logs with the loss (``forge.train.memory.peak_memory``): on CUDA the
allocator's peak of allocated memory; on CPU the process's peak RSS. "above base" is that
peak less the baseline: the activations, gradients and temporaries of a step. Reported per
variant: the median over runs, and the spread (min-max) over runs; step time is each run's
median step.

    .venv/bin/python bench/activation_memory.py [--repeat 3] [--models tiny_lm,adaptive]
        [--device cpu|cuda] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name: (description, batch size, sequence length)
MODELS = {
    "tiny_lm": ("Llama hidden 128, 4 layers, vocab 4096 (tiny_lm's)", 32, 128),
    "adaptive": ("AdaptiveComputationModel hidden 128, 2 blocks, <= 8 passes", 256, 32),
}


def build(name: str):
    """The model and one seeded batch maker."""
    import torch

    torch.manual_seed(0)
    _, batch, length = MODELS[name]
    if name == "tiny_lm":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=128 * 8 // 3,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=length,
            attention_dropout=0.1,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(config)

        def make_batch(generator):
            ids = torch.randint(1, 4096, (batch, length), generator=generator)
            return {"input_ids": ids, "labels": ids}

        return model, make_batch
    from forge.models import AdaptiveComputationModel

    model = AdaptiveComputationModel(
        10, 10, length, hidden_size=128, ffn_size=256, num_blocks=2, max_steps=8, dropout=0.1
    )

    def make_batch(generator):
        digits = torch.randint(10, (batch, length), generator=generator)
        return {"input_ids": digits, "labels": digits.sort().values}

    return model, make_batch


def measure(name: str, checkpointing: bool, device_name: str, warmup: int, steps: int) -> dict:
    """One run in this process (a child of the parent's loop)."""
    import torch

    from forge.train import TrainingArguments
    from forge.train.memory import peak_memory
    from forge.train.transforms import apply_activation_checkpointing

    device = torch.device(device_name)
    model, make_batch = build(name)
    model.to(device).train()
    args = TrainingArguments(
        output_dir="/tmp/unused", report_to="none", activation_checkpointing=checkpointing
    )
    described = apply_activation_checkpointing(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():  # AdamW's state exists before the baseline is taken
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(1)
    batches = [
        {k: v.to(device) for k, v in make_batch(generator).items()} for _ in range(warmup + steps)
    ]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device) / 2**20
        peak_memory(device)  # resets the peak
        key = "peak_memory_allocated_mb"
    else:
        base = _resident_mb()
        key = "peak_rss_mb"
    times = []
    for batch in batches:
        start = time.perf_counter()
        loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = peak_memory(device)[key]
    return {
        "step_ms": statistics.median(times[warmup:]) * 1000,
        "peak_mb": peak,
        "above_base_mb": peak - base,
        "wrapped": described or "off",
    }


def _resident_mb() -> float:
    """The resident set size now (Linux), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (this measurement needs Linux)")


def run_child(name: str, checkpointing: bool, options: argparse.Namespace) -> dict:
    command = [
        sys.executable, __file__, "--child", name, "--device", options.device,
        "--warmup", str(options.warmup), "--steps", str(options.steps),
        "--threads", str(options.threads),
    ]  # fmt: skip
    if checkpointing:
        command.append("--checkpointing")
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} (checkpointing {checkpointing}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], digits: int = 1) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--quick", action="store_true", help="1 run of 2 steps per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        import torch

        torch.set_num_threads(options.threads)
        result = measure(
            options.child, options.checkpointing, options.device, options.warmup, options.steps
        )
        print(json.dumps(result))
        return 0
    if options.quick:
        options.repeat, options.warmup, options.steps = 1, 1, 2
    names = [n.strip() for n in options.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {','.join(MODELS)}")
    memory = "peak allocated" if options.device.startswith("cuda") else "peak RSS"
    print(
        f"device {options.device}, {options.threads} thread(s); {options.repeat} run(s) per "
        f"variant, each a fresh process timing {options.steps} steps after {options.warmup}; "
        f"memory: {memory} (MiB), median and min-max over runs"
    )
    print(
        f"\n{'model, checkpointing':<24}{'ms/step':>9}{'spread':>15}{'peak':>9}"
        f"{'above base':>12}{'spread':>15}{'vs off':>8}"
    )
    for name in names:
        description, batch, length = MODELS[name]
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(options.repeat):
            for checkpointing in (False, True):
                runs[checkpointing].append(run_child(name, checkpointing, options))
        base_above = statistics.median(r["above_base_mb"] for r in runs[False])
        for checkpointing in (False, True):
            results = runs[checkpointing]
            step = [r["step_ms"] for r in results]
            peak = [r["peak_mb"] for r in results]
            above = [r["above_base_mb"] for r in results]
            ratio = statistics.median(above) / base_above if base_above > 0 else float("nan")
            label = f"{name}, {'on' if checkpointing else 'off'}"
            print(
                f"{label:<24}{statistics.median(step):>9.1f}{spread(step):>15}"
                f"{statistics.median(peak):>9.1f}{statistics.median(above):>12.1f}"
                f"{spread(above):>15}{ratio:>8.2f}"
            )
        print(f"  {name}: {description}; batch {batch} x {length}; on: {runs[True][0]['wrapped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
