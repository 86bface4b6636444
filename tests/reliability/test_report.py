"""`make reliability`'s page (scripts/reliability.py) says what the run saw: a failed test or a
kill that lost a checkpoint shows up in it, and the page can be rewritten from a run's records."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reliability.py"


@pytest.fixture(scope="module")
def reliability():
    spec = importlib.util.spec_from_file_location("reliability_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def junit(cases: list[tuple[str, str, str]]) -> str:
    """JUnit XML with (file, name, outcome) test cases as pytest writes them."""
    rows = []
    for file, name, outcome in cases:
        classname = file.removesuffix(".py").replace("/", ".")
        body = {"passed": "", "failed": '<failure message="boom"/>'}.get(outcome, "")
        if outcome == "skipped":
            body = '<skipped message="no tmpfs"/>'
        rows.append(f'<testcase classname="{classname}" name="{name}" time="1.5">{body}</testcase>')
    return f'<testsuites><testsuite name="pytest">{"".join(rows)}</testsuite></testsuites>'


def kill_record(trainer: str, *, lost: bool, identical: bool) -> dict:
    return {
        "trainer": trainer,
        "config": "train",
        "nproc": 1,
        "max_steps": 200,
        "save_steps": 3,
        "bit_identical": identical,
        "problems": [] if identical else ["final weights differ"],
        "seconds": 10.0,
        "kill_count": 2,
        "resumes_ok": 2,
        "kinds": {"random": 2},
        "seen_on_disk": {"between saves": 2},
        "kills": [
            {"kind": "random", "problems": ["checkpoint-000006 lost"] if lost else []},
            {"kind": "random", "problems": []},
        ],
    }


def write_records(directory: Path, cases, kills) -> Path:
    directory.mkdir()
    (directory / "junit.xml").write_text(junit(cases))
    run = {
        "started": "2026-01-02T03:04+00:00",
        "commit": "abc1234",
        "command": "pytest",
        "cores": 2,
    }
    (directory / "run.json").write_text(json.dumps(run))
    for record in kills:
        (directory / f"kills-{record['trainer']}.json").write_text(json.dumps(record))
    return directory


def test_a_clean_run_reads_all_passed(reliability, tmp_path):
    cases = [
        ("tests/reliability/test_kills.py", "test_two_kills", "passed"),
        ("tests/reliability/test_concurrency.py", "test_locks", "passed"),
    ]
    records = write_records(
        tmp_path / "r", cases, [kill_record("plain-1", lost=False, identical=True)]
    )
    page = tmp_path / "RELIABILITY.md"
    assert reliability.main(["--records", str(records), "--output", str(page)]) == 0
    text = page.read_text()
    assert "commit abc1234, 2 CPU core(s)" in text
    assert "| Kills: the kill harness |" in text and "2 kills (1 trainers)" in text
    assert "| plain-1 (train.yaml) | 1 | 2 | 2 of 2 | 0 | yes |" in text
    assert "None: all 2 tests passed." in text
    assert "| Full disk |" in text and "not run" in text  # a scenario with no tests says so


def test_a_failure_a_skip_and_a_lost_checkpoint_are_on_the_page(reliability, tmp_path):
    cases = [
        ("tests/reliability/test_kills.py", "test_twenty", "failed"),
        ("tests/reliability/test_concurrency.py", "test_locks", "passed"),
        ("tests/integration/test_disk_full_cli.py", "test_tmpfs", "skipped"),
    ]
    kills = [kill_record("accel-2", lost=True, identical=False)]
    records = write_records(tmp_path / "r", cases, kills)
    page = tmp_path / "RELIABILITY.md"
    reliability.main(["--records", str(records), "--output", str(page)])
    text = page.read_text()
    assert "**1 FAILED**" in text
    assert "- FAILED `tests/reliability/test_kills.py::test_twenty`" in text
    assert "- skipped: no tmpfs `tests/integration/test_disk_full_cli.py::test_tmpfs`" in text
    assert "| accel-2 (train.yaml) | 1 | 2 | 2 of 2 | 1 | **NO** |" in text
    assert "- accel-2 kill 1 (random): checkpoint-000006 lost" in text
    assert "- accel-2: final weights differ" in text


def test_records_without_results_leave_the_page_alone(reliability, tmp_path):
    page = tmp_path / "RELIABILITY.md"
    page.write_text("earlier page\n")
    (tmp_path / "empty").mkdir()
    assert reliability.main(["--records", str(tmp_path / "empty"), "--output", str(page)]) == 1
    assert page.read_text() == "earlier page\n"
