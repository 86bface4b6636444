"""bench/sweep_trials.py runs and reports what it promises: a smoke test of the benchmark, not a
timed test (no figure is compared with a bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "sweep_trials.py"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_figures_of_every_contender():
    pytest.importorskip("optuna")
    command = [sys.executable, str(SCRIPT), "--json", "--trials", "2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    for name in ("forge_forked", "forge_fresh", "hf_optuna"):
        figures = results[name]
        assert figures["trials"] == 2 and figures["wall_s"] > 0
        low, high = figures["fixed_s_spread"]
        assert low <= figures["fixed_s_median"] <= high
    assert set(results["ratios"]) == {"fixed_forked_vs_hf", "fixed_fresh_vs_forked"}
    assert results["machine"]["load_start"] >= 0
