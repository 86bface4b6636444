"""Run every forge benchmark in one go, each under a heading: CLI start-up, training
throughput, checkpoint speed (bench/checkpoint.py), the pipeline trainer's throughput and
saves, peak memory and step time with and without activation checkpointing, and
variable-length batches (padding, real tokens/s and resume of length-grouped batches,
bench/variable_length.py), the model state and checkpoint bytes per rank under DDP, FSDP
and HSDP (bench/sharding_memory.py), streams (bench/streaming.py) and a sweep trial's fixed
cost against HF's hyperparameter_search (bench/sweep_trials.py). Each runs as a subprocess of
this interpreter; the command exits non-zero when any of them fails (the others still run).

    .venv/bin/python bench/run.py [--quick] [--only train_speed,startup]   (also: make bench)

``--quick`` shrinks the repeats and steps of every benchmark: a smoke run, not a measurement.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# name: (script, extra arguments for --quick); the scripts' own defaults are the full run
SECTIONS: dict[str, tuple[str, list[str]]] = {
    "startup": ("startup.py", ["--repeat", "3"]),
    "train_speed": ("train_speed.py", ["--quick"]),
    "checkpoint": (
        "checkpoint.py",
        ["--sizes", "1M", "--repeat", "1", "--steps", "20", "--late", "40"],
    ),
    "pipeline_speed": ("pipeline_speed.py", ["--quick"]),
    "activation_memory": ("activation_memory.py", ["--quick"]),
    "variable_length": ("variable_length.py", ["--quick"]),
    "sharding_memory": ("sharding_memory.py", ["--quick"]),
    "streaming": ("streaming.py", ["--quick"]),
    "sweep_trials": ("sweep_trials.py", ["--trials", "3"]),
}


def run_section(name: str, quick: bool) -> tuple[int, float]:
    script, quick_args = SECTIONS[name]
    command = [sys.executable, str(BENCH / script), *(quick_args if quick else [])]
    shown = " ".join(["python", f"bench/{script}", *(quick_args if quick else [])])
    print(f"\n== {name}: {shown}", flush=True)
    start = time.perf_counter()
    returncode = subprocess.run(command, cwd=REPO).returncode
    return returncode, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}"
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        parser.error(f"--only: unknown {unknown}; choose from {','.join(SECTIONS)}")

    failed = []
    for name in names:
        returncode, seconds = run_section(name, args.quick)
        status = "ok" if returncode == 0 else f"FAILED (exit {returncode})"
        print(f"-- {name}: {status} in {seconds:.0f} s", flush=True)
        if returncode != 0:
            failed.append(name)
    print(f"\nbench: {len(names) - len(failed)} of {len(names)} sections ok", end="")
    print(f"; failed: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
