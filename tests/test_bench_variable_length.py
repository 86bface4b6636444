"""bench/variable_length.py runs on a slice of its corpus and reports what it promises.

A smoke test of the benchmark, not a timed test: the figures' order is asserted where it is a
property of the data (random batches pad more than grouped ones), never a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "variable_length.py"

pytestmark = pytest.mark.integration


def run_bench(tmp_path: Path, *extra: str) -> dict:
    command = [sys.executable, str(SCRIPT), "--json", "--max-files", "30", "--epochs", "1"]
    command += ["--cache-dir", str(tmp_path), "--resume-repeat", "2", *extra]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_padding_and_resume_figures(tmp_path: Path) -> None:
    results = run_bench(tmp_path, "--parts", "padding,resume")

    assert results["corpus"]["documents"] > 16
    padding = results["padding"]
    assert set(padding) >= {"plain", "forge_grouped", "hf_grouped", "forge_token_budget", "packed"}
    plain, grouped = padding["plain"], padding["forge_grouped"]
    assert plain["padding_fraction"] > grouped["padding_fraction"] > 0
    assert padding["hf_grouped"] == grouped and padding["forge_order_equals_hf"]
    assert padding["packed"]["padding_fraction"] == 0
    assert padding["packed"]["attention_pairs_packed_vs_needed"] > 1  # its mask's cost
    resume = results["resume"]
    assert resume["first_batch_is_the_next_one"]
    assert resume["early_step"] < resume["late_step"] < resume["epoch_steps"]
    assert set(results["ratios"]) == {"padding_grouped_vs_plain", "resume_late_vs_early"}
    assert results["machine"]["load_start"] >= 0


@pytest.mark.slow
def test_throughput_of_every_contender(tmp_path: Path) -> None:
    results = run_bench(
        tmp_path, "--parts", "throughput", "--repeat", "1", "--warmup", "1", "--steps", "2"
    )

    throughput = results["throughput"]
    assert set(throughput) == {
        "forge grouped",
        "HF grouped",
        "HF grouped, forge's order",
        "forge padded",
        "forge packed",
    }
    for row in throughput.values():
        assert row["tokens_per_s"]["median"] > 0 and row["real_tokens"][0] > 0
        assert row["robust_tokens_per_s"] > 0
    pairs = (
        "forge_vs_hf_grouped",
        "forge_vs_hf_same_batches",
        "grouped_vs_padded",
        "packed_vs_padded",
        "packed_vs_grouped",
    )
    keys = {f"{pair}_tokens_per_s{kind}" for pair in pairs for kind in ("", "_robust")}
    assert set(results["ratios"]) == keys
    same = throughput["HF grouped, forge's order"]["real_tokens"]
    assert same == throughput["forge grouped"]["real_tokens"]  # the same batches
