"""Start-up cost of the CLI: `forge --help` and `forge render` of the default project,
against a bare `python -c pass`, in one run. Prints medians and ratios.

Target: `forge render` of the default project under 0.5 s.

    .venv/bin/python bench/startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = REPO / "projects" / "tiny_lm"


def median_seconds(command: list[str], repeat: int) -> float:
    subprocess.run(command, capture_output=True, check=True)  # warm the page cache
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    python = [sys.executable]
    cases = {
        "python -c pass": python + ["-c", "pass"],
        "forge --help": python + ["-m", "forge.cli", "--help"],
        "forge render (tiny_lm)": python + ["-m", "forge.cli", "render", "-p", str(PROJECT)],
    }
    results = {name: median_seconds(cmd, args.repeat) for name, cmd in cases.items()}
    base = results["python -c pass"]
    print(f"{'case':28s} {'median s':>9s} {'x python':>9s}")
    for name, seconds in results.items():
        print(f"{name:28s} {seconds:9.3f} {seconds / base:9.1f}")
    render = results["forge render (tiny_lm)"]
    verdict = "meets" if render < 0.5 else "misses"
    print(f"forge render: {render:.3f} s, {verdict} the 0.5 s target")


if __name__ == "__main__":
    main()
