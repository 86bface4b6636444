"""SIGKILL inside saves, during rotation and at random moments, resumed after each kill: no
committed checkpoint is lost and the run ends bit-identical to an uninterrupted one
(tests/reliability/kill_harness.py has the harness).

The default suite runs two kills of the one-process trainer, with synchronous and with async
saves; `make reliability` runs 20 per trainer (plain with 1 and 2 processes, Accelerate with 2,
pipeline with 2 stages) and keeps each trainer's record for docs/RELIABILITY.md; the slow
``-async`` variants do the same with ``async_save: true``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.reliability.kill_harness import ASYNC_TRAINERS, TRAINERS, run_trainer

pytestmark = pytest.mark.integration

REPORT_DIR = "FORGE_RELIABILITY_DIR"  # where `make reliability` collects the records
KILLS = int(os.environ.get("FORGE_KILLS", "20"))


def record(result) -> None:
    directory = os.environ.get(REPORT_DIR)
    if directory:
        path = Path(directory) / f"kills-{result.trainer}.json"
        path.write_text(json.dumps(result.summary(), indent=2))


def test_two_kills_of_the_one_process_trainer_lose_nothing(tmp_path):
    result = run_trainer(TRAINERS[0], tmp_path, kills=2, max_steps=60, save_steps=3)
    assert result.ok, json.dumps(result.summary(), indent=2)
    assert [k.kind for k in result.kills] == ["after-file", "random"]
    assert result.kills[0].seen_on_disk == "inside a save: no manifest yet"


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINERS, ids=[c.name for c in TRAINERS])
def test_twenty_kills_per_trainer_lose_nothing(tmp_path, case):
    result = run_trainer(case, tmp_path, kills=KILLS)
    record(result)
    assert result.ok, json.dumps(result.summary(), indent=2)
    assert len(result.kills) == KILLS


@pytest.mark.slow
def test_two_kills_inside_async_commits_lose_nothing(tmp_path):
    """``async_save: true``: the first kill lands inside a background commit."""
    result = run_trainer(ASYNC_TRAINERS[0], tmp_path, kills=2, max_steps=60, save_steps=3)
    assert result.ok, json.dumps(result.summary(), indent=2)
    assert [k.kind for k in result.kills] == ["after-file", "random"]
    assert result.kills[0].seen_on_disk == "inside a save: no manifest yet"
    assert result.bit_identical


@pytest.mark.slow
@pytest.mark.parametrize("case", ASYNC_TRAINERS, ids=[c.name for c in ASYNC_TRAINERS])
def test_kills_inside_async_commits_lose_nothing(tmp_path, case):
    result = run_trainer(case, tmp_path, kills=KILLS)
    record(result)
    assert result.ok, json.dumps(result.summary(), indent=2)
    assert len(result.kills) == KILLS
