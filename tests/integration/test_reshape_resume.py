"""A map-style run, and a stream, resumed on another data-parallel size, with real processes:
the epoch goes on, every item of it used once across the change (tests/train/test_data_reshape.py
and tests/data/test_streams.py have the dealing itself, in one process). The project records the ids each rank trains on, step by step
(tests/integration/data/item_ids.py); the runs stop at their checkpoint (max_steps), so what
each run recorded is exactly what the checkpoint holds as used."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import run_forge

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DATA = Path(__file__).parent / "data"
ITEMS = 96  # 4 per micro-batch, 2 micro-batches per step: 8 items per step and rank


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("reshape")
    made = run_forge("new", "ids_project", "--from", "classifier", cwd=where)
    assert made.returncode == 0, made.stderr
    project = where / "ids_project"
    shutil.copy(DATA / "item_ids.py", project)
    for config in ("ids.yaml", "ids_stream.yaml"):
        shutil.copy(DATA / config, project / "templates" / "configs")
    return project


@pytest.fixture
def project(scaffold, tmp_path) -> Path:
    dest = tmp_path / "ids_project"
    shutil.copytree(scaffold, dest, ignore=shutil.ignore_patterns("output"))
    return dest


def forge(*args: str) -> tuple[Path, str]:
    """Run forge (each run limited to run_forge's timeout); its run directory and stderr."""
    result = run_forge(*args)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0]), result.stderr


def ids_by_step(run_dir: Path) -> dict[int, list[int]]:
    """step -> the ids every rank trained on in it."""
    steps: dict[int, list[int]] = {}
    for file in sorted(run_dir.glob("ids-rank-*.jsonl")):
        for line in file.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["step"], []).extend(row["ids"])
    return steps


def assert_each_item_once(*runs: dict[int, list[int]]) -> None:
    used = Counter(i for steps in runs for ids in steps.values() for i in ids)
    twice = sorted(i for i, n in used.items() if n > 1)
    assert not twice, f"items used twice across the change: {twice}"
    assert sorted(used) == list(range(ITEMS)), "items of the epoch never used"


@pytest.mark.parametrize(
    ("before", "after", "stop", "end", "change"),
    [
        # 5 steps of 8 items; the other 56 on two ranks: 7 micro-batches each, 4 steps
        ("1", "2", 5, 9, "the global batch was 8 (4 x 2 x 1), it is now 16 (4 x 2 x 2)"),
        # 2 steps of 16 items; the other 64 on one rank: 16 micro-batches, 8 steps
        ("2", "1", 2, 10, "the global batch was 16 (4 x 2 x 2), it is now 8 (4 x 2 x 1)"),
    ],
)
def test_a_resume_on_another_process_count_uses_each_item_of_the_epoch_once(
    project, before, after, stop, end, change
):
    p = str(project)
    run_dir, _ = forge("train", "ids", "-p", p, "--nproc", before, "-D", f"max_steps={stop}")
    _, stderr = forge("resume", "-p", p, "--nproc", after, "--set", f"trainer.args.max_steps={end}")
    assert f"epoch 0 continues: {stop * 8 * int(before)} of its {ITEMS} items were used" in stderr
    assert change in stderr
    assert "restarts from its first batch" not in stderr
    steps = ids_by_step(run_dir)
    assert sorted(steps) == list(range(1, end + 1))  # one record per step, none replayed
    assert_each_item_once(steps)


@pytest.mark.parametrize(
    "trainer",
    [
        ("-D", "trainer_class=forge.train:AccelTrainer",
         "-D", "trainer_args_class=forge.train:AccelTrainingArguments"),
        ("--set", "trainer.args.fsdp=full_shard"),
    ],
    ids=["accelerate", "fsdp"],
)  # fmt: skip
def test_a_plain_checkpoint_continues_its_epoch_under_another_trainer_on_two_processes(
    project, trainer
):
    p = str(project)
    plain, _ = forge("train", "ids", "-p", p, "-D", "max_steps=5")
    checkpoint = plain / "checkpoints" / "checkpoint-000005"
    resume = f"trainer.args.resume_from_checkpoint={checkpoint}"
    plan = run_forge(
        "train", "ids", "-p", p, "--nproc", "2", "--dry-run", "--set", resume, *trainer
    )
    assert plan.returncode == 0, plan.stderr
    assert (
        "  resume        checkpoint-000005 was written by 1 data-parallel rank(s): the rest of "
        "its epoch is dealt to these 2; its global batch was 8 (4 x 2 x 1)"
    ) in plan.stdout.splitlines()
    continued, stderr = forge(
        "train", "ids", "-p", p, "--nproc", "2", "-D", "max_steps=9", "--set", resume, *trainer
    )
    assert "epoch 0 continues: 40 of its 96 items were used" in stderr
    steps = ids_by_step(continued)
    assert sorted(steps) == [6, 7, 8, 9]
    assert_each_item_once(ids_by_step(plain), steps)


def ids_of_rank(run_dir: Path, rank: int, steps: range) -> list[int]:
    """The ids ``rank`` trained on in ``steps``, in the order it read them."""
    rows = (json.loads(line) for line in (run_dir / f"ids-rank-{rank}.jsonl").open())
    return [i for row in rows if row["step"] in steps for i in row["ids"]]


def test_a_stream_resumed_on_two_processes_deals_the_rest_of_its_epoch_once(project):
    """The ids as a shuffled stream of 8 shards: 5 steps on 1 process (40 items), then 7 steps
    on 2 (56 items a rank). Each rank reads what it was dealt of epoch 0, then its share of
    epoch 1: a head of each rank's ids must be the 56 unused items of epoch 0, once each."""
    p = str(project)
    run_dir, _ = forge("train", "ids_stream", "-p", p, "-D", "max_steps=5")
    _, stderr = forge("resume", "-p", p, "--nproc", "2", "--set", "trainer.args.max_steps=12")
    assert "the stream continues in its epoch 0" in stderr and "dealt to 2 reader(s)" in stderr
    used = ids_of_rank(run_dir, 0, range(1, 6))
    assert len(set(used)) == 40
    ranks = [ids_of_rank(run_dir, rank, range(6, 13)) for rank in (0, 1)]
    assert [len(ids) for ids in ranks] == [56, 56]
    heads = [
        (n, 56 - n)
        for n in range(57)
        if sorted(used + ranks[0][:n] + ranks[1][: 56 - n]) == list(range(ITEMS))
    ]
    assert heads, f"no head of the two ranks' ids completes epoch 0 once: {used=} {ranks=}"
