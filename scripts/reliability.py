"""`make reliability`: run the whole reliability suite and write docs/RELIABILITY.md from it.

Runs pytest on the reliability tests with the slow ones included (the kill harness with 20
kills per trainer, hundreds of generated hostile inputs, ...), keeping pytest's JUnit XML and
the kill harness's per-trainer records, then writes the document's results: each scenario, how
many trials it ran and what was seen. The page's hand-written introduction (everything above
its ``MARKER`` line) is kept; the results below it are rewritten, only from a complete run.

    python scripts/reliability.py [--output docs/RELIABILITY.md] [--kills 20] [-- PYTEST ARGS]
    python scripts/reliability.py --records DIR   # rewrite the page from a finished run's records
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' settings (hypothesis example counts) are read back
TESTS = [
    "tests/reliability",
    "tests/integration/test_save_faults.py",
    "tests/integration/test_disk_full_cli.py",
    "tests/integration/test_resume_refuses_code.py",
    "tests/integration/test_train_resume.py",
    "tests/config/test_sandbox.py",
    "tests/config/test_fuzz.py",
]


# The line between a page's hand-written introduction and the results this script writes.
MARKER = (
    "<!-- Everything below this line is written by `make reliability` (scripts/reliability.py) "
    "from its last complete run; edit the text above it. -->"
)
# The introduction of a page that has none yet.
DEFAULT_INTRODUCTION = (
    "# Reliability\n\nWhat forge does when a run is killed, its files are damaged or hostile, "
    "its disk fills up or two commands meet on one project, and what one full run of the suite "
    "saw.\n\n"
)


@dataclass
class Scenario:
    title: str
    checks: str
    tests: tuple[str, ...]  # test ids (file::name) that make it up, by prefix


SCENARIOS = [
    Scenario(
        "Kills: the kill harness",
        "SIGKILL after a chosen file of a save, before the manifest, before the rename, at "
        "random moments, during rotation, of one rank; resume after each; final weights and "
        "optimizer state bit-identical to an uninterrupted run (table below)",
        ("tests/reliability/test_kills.py",),
    ),
    Scenario(
        "Kills at fixed points of a save",
        "a process killed between two file writes or before the manifest (1 and 2 processes), "
        "resumed: bit-identical to an uninterrupted run; a failed write on one rank ends every "
        "rank with exit 1",
        ("tests/integration/test_save_faults.py",),
    ),
    Scenario(
        "SIGTERM, SIGINT, SIGKILL then forge resume",
        "stopped after the step-20 checkpoint and resumed: bit-identical (1 and 2 processes)",
        ("tests/integration/test_train_resume.py",),
    ),
    Scenario(
        "A scheduler's stop (preemption, time limit)",
        "SIGTERM, SIGINT or SLURM's warning signal sent to forge, its process group or every "
        "process of the job, at a random step, loader workers running (every trainer, 1 and 2 "
        "processes): one checkpoint of the last step, status interrupted, exit 128+N, resume "
        "bit-identical; --requeue with a fake scontrol; a stop while node 0 waits",
        ("tests/reliability/test_preemption.py",),
    ),
    Scenario(
        "Elastic restarts (--max-restarts)",
        "a worker SIGKILLed mid-run is restarted by torchrun and continues from the run's "
        "newest checkpoint with no user command; run.json records the restart; the end is "
        "bit-identical (1 and 2 processes)",
        ("tests/reliability/test_elastic.py",),
    ),
    Scenario(
        "Corruption",
        "truncated, altered, missing and extra files, no or a malformed manifest, a shard from "
        "another step (manifest agreeing), a topology that does not fit the files, a leftover "
        "temporary directory: named by forge checkpoints --verify, skipped by discovery, "
        "forge resume continues from the newest good checkpoint",
        ("tests/reliability/test_corruption.py",),
    ),
    Scenario(
        "Pickled code in a checkpoint",
        "a shared, per-rank, stage-scoped or pipeline-stage state file carrying a callable "
        "(hashes updated): refused by validation, --verify, discovery and resume --from; the "
        "code never runs",
        (
            "tests/integration/test_resume_refuses_code.py",
            "tests/reliability/test_hostile.py::test_a_pipeline_stage_file",
        ),
    ),
    Scenario(
        "Malformed run directories (hypothesis)",
        "generated damage to run.json, config.yaml, a manifest or checkpoint files: forge runs, "
        "forge checkpoints --verify and forge resume end with exit 0/1/2 and a message naming "
        "the file, never a traceback",
        ("tests/reliability/test_hostile.py::test_damaged",),
    ),
    Scenario(
        "Hostile and malformed templates",
        "sandbox escapes refused when rendering, listing and building; generated templates, "
        "YAML, -D/--set values and meta.yaml end with exit 2 and a located message",
        ("tests/config/test_sandbox.py", "tests/config/test_fuzz.py"),
    ),
    Scenario(
        "Full disk",
        "a save meeting a full disk (a real small tmpfs): one disk-full message, exit 1, no "
        "partial checkpoint, the earlier one valid, resume once space is freed; plain and "
        "Accelerate (1 and 2 processes)",
        (
            "tests/integration/test_disk_full_cli.py",
            "tests/reliability/test_disk_full_accel.py",
        ),
    ),
    Scenario(
        "Concurrency",
        "two forge train at once get distinct runs and build the tokenizer and token caches "
        "once; forge resume of a live run is refused naming its pid (also when its launcher "
        "was killed and its workers live on); a killed run's lock is gone and resume continues",
        ("tests/reliability/test_concurrency.py",),
    ),
]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "docs" / "RELIABILITY.md"))
    parser.add_argument("--kills", type=int, default=20, help="kills per trainer")
    parser.add_argument(
        "--records",
        metavar="DIR",
        help="do not run: write the page from the records of an earlier run (printed at its end)",
    )
    args = parser.parse_args(argv)

    code = 0
    if args.records:
        records = Path(args.records)
    else:
        records = Path(tempfile.mkdtemp(prefix="forge-reliability-"))
        code = run_suite(records, args.kills, extra)
    junit = records / "junit.xml"
    if not junit.exists():
        print(f"no test results in {records}; {args.output} unchanged", file=sys.stderr)
        return code or 1
    run = json.loads((records / "run.json").read_text())
    kills = [json.loads(p.read_text()) for p in sorted(records.glob("kills-*.json"))]
    output = Path(args.output)
    existing = output.read_text() if output.is_file() else None
    text = page(existing, render(parse_junit(junit), kills, run))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(f"wrote {args.output} (records in {records})")
    return code


def run_suite(records: Path, kills: int, extra: list[str]) -> int:
    """pytest over TESTS with the slow tests; its JUnit XML and the run's facts in ``records``."""
    env = dict(os.environ, FORGE_RELIABILITY_DIR=str(records), FORGE_KILLS=str(kills))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    run = {
        "started": dt.datetime.now().astimezone().isoformat(timespec="minutes"),
        "commit": commit or "unknown",
        "command": " ".join(["pytest", "-m", '""', *TESTS, *extra]),
        "cores": len(os.sched_getaffinity(0)),
    }
    (records / "run.json").write_text(json.dumps(run, indent=2))
    junit = records / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-m", "", "-q", f"--junitxml={junit}", *TESTS]
    return subprocess.call([*command, *extra], cwd=REPO, env=env)


def parse_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")
        cases.append(
            {
                "id": f"{file}::{case.get('name')}",
                "seconds": float(case.get("time") or 0),
                "outcome": outcome,
            }
        )
    return cases


def _examples(case_id: str) -> int:
    """Generated examples a hypothesis test tries (its settings), else 1."""
    if "test_damaged_run_directories" in case_id:
        from tests.reliability.test_hostile import FAST, SLOW
    elif "test_fuzz.py" in case_id and "test_malformed" in case_id:
        from tests.config.test_fuzz import FAST, SLOW
    else:
        return 1
    return (SLOW if case_id.endswith("_many") else FAST).max_examples


def page(existing: str | None, results: str) -> str:
    """The page: the introduction of ``existing`` (all above its MARKER line, else the default
    introduction), the MARKER line, then ``results``."""
    if existing and MARKER in existing:
        introduction = existing.split(MARKER, 1)[0]
    else:
        introduction = DEFAULT_INTRODUCTION
    return introduction + MARKER + "\n\n" + results


def render(cases: list[dict], kills: list[dict], run: dict) -> str:
    """The results part of the page (what goes below MARKER)."""
    import torch

    started = dt.datetime.fromisoformat(run["started"])
    lines = [
        "## The last run",
        "",
        "`make reliability` runs the suite with its slow tests and records each scenario's trials.",
        "",
        f"Last run: {started:%Y-%m-%d %H:%M %Z}, commit {run['commit']}, "
        f"{run['cores']} CPU core(s) available, Python {platform.python_version()}, torch "
        f"{torch.__version__}, on CPU with the gloo backend. Command: `{run['command']}`.",
        "",
        "### Scenarios",
        "",
        "| scenario | what is checked | trials | result | time |",
        "|---|---|---|---|---|",
    ]
    used = set()
    for scenario in SCENARIOS:
        mine = [c for c in cases if c["id"].startswith(scenario.tests)]
        used.update(c["id"] for c in mine)
        lines.append(_scenario_row(scenario, mine, kills))
    rest = [c for c in cases if c["id"] not in used]
    if rest:
        lines.append(_scenario_row(Scenario("Other tests of these files", "", ()), rest, kills))
    lines += ["", "### The kill harness", ""]
    lines += _kill_section(kills)
    failed = [c for c in cases if c["outcome"] == "failed"]
    skipped = [c for c in cases if c["outcome"].startswith("skipped")]
    lines += ["", "### Failures and skips", ""]
    if not failed and not skipped:
        lines.append(f"None: all {len(cases)} tests passed.")
    for case in failed:
        lines.append(f"- FAILED `{case['id']}`")
    for case in skipped:
        lines.append(f"- {case['outcome']} `{case['id']}`")
    return "\n".join(lines) + "\n"


def _scenario_row(scenario: Scenario, mine: list[dict], kills: list[dict]) -> str:
    if scenario.tests == ("tests/reliability/test_kills.py",) and kills:
        total = sum(k["kill_count"] for k in kills)
        trials = f"{total} kills ({len(kills)} trainers) + 4 in the fast tests"
    else:
        trials = f"{sum(_examples(c['id']) for c in mine)} ({len(mine)} tests)"
    failed = sum(c["outcome"] == "failed" for c in mine)
    skipped = sum(c["outcome"].startswith("skipped") for c in mine)
    if not mine:
        result = "not run"
    elif failed:
        result = f"**{failed} FAILED**"
    else:
        result = "all passed" + (f" ({skipped} skipped)" if skipped else "")
    seconds = sum(c["seconds"] for c in mine)
    return f"| {scenario.title} | {scenario.checks} | {trials} | {result} | {seconds:.0f} s |"


def _kill_section(kills: list[dict]) -> list[str]:
    if not kills:
        return ["The full harness did not run (no records)."]
    lines = [
        "Each trainer trains the small tiny_lm (tests/integration/conftest.py SMALL) for "
        f"{kills[0]['max_steps']} steps with a checkpoint every {kills[0]['save_steps']} steps "
        "and save_total_limit 2 once straight through, then again with the kills below, "
        "resuming with `forge resume` after each, and once more to the end. After every kill "
        "each checkpoint under a final name must be valid, every checkpoint the job reported "
        "saved (and not rotated away) must still be there, and the next resume must start "
        "from the newest valid checkpoint.",
        "",
        "| trainer | processes | kills | resumed from the newest valid checkpoint | "
        "committed checkpoints lost | final state bit-identical | time |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in kills:
        lost = sum(any("lost" in p for p in kill["problems"]) for kill in k["kills"])
        lines.append(
            f"| {k['trainer']} ({k['config']}.yaml) | {k['nproc']} | {k['kill_count']} | "
            f"{k['resumes_ok']} of {k['kill_count']} | {lost} | "
            f"{'yes' if k['bit_identical'] else '**NO**'} | {k['seconds']:.0f} s |"
        )
    kinds = Counter()
    seen = Counter()
    for k in kills:
        kinds.update(k["kinds"])
        seen.update(k["seen_on_disk"])
    lines += ["", "Kills by kind (all trainers):", ""]
    lines += [f"- {kind}: {count}" for kind, count in sorted(kinds.items())]
    lines += ["", "Where the kills came, judged from what each left on disk:", ""]
    lines += [f"- {where}: {count}" for where, count in seen.most_common()]
    problems = [f"- {k['trainer']}: {p}" for k in kills for p in k["problems"]] + [
        f"- {k['trainer']} kill {i + 1} ({kill['kind']}): {p}"
        for k in kills
        for i, kill in enumerate(k["kills"])
        for p in kill["problems"]
    ]
    lines += ["", "Problems seen:", ""] + (problems or ["- none"])
    return lines


if __name__ == "__main__":
    sys.exit(main())
