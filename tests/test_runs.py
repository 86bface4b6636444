"""Run directories: numbering, records, and finding the run to resume."""

from __future__ import annotations

import json
import threading

import pytest

from forge.runs import RunError, RunRecord, create_run, find_run, list_run_dirs


def make_run(config_dir, project_root, name="train.yaml"):
    return create_run(
        config_dir,
        config_name=name,
        config_text="meta: 1\n",
        project_root=project_root,
        overrides=["trainer.args.max_steps=3"],
        variables={"max_steps": 3},
        nproc=1,
    )


def test_runs_are_numbered_and_recorded(tmp_path):
    first = make_run(tmp_path / "output" / "train", tmp_path)
    second = make_run(tmp_path / "output" / "train", tmp_path)
    assert (first.name, second.name) == ("run_001", "run_002")
    record = json.loads((second / "run.json").read_text())
    assert record["run"] == 2 and record["status"] == "created"
    assert record["overrides"] == ["trainer.args.max_steps=3"]
    assert (second / "config.yaml").read_text() == "meta: 1\n"


def test_concurrent_creation_gets_distinct_numbers(tmp_path):
    made = []
    threads = [
        threading.Thread(target=lambda: made.append(make_run(tmp_path / "c", tmp_path)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({p.name for p in made}) == 8
    assert len(list_run_dirs(tmp_path / "c")) == 8


def test_record_updates_are_atomic_and_keep_history(tmp_path):
    run = make_run(tmp_path / "c", tmp_path)
    record = RunRecord.load(run)
    record.add_checkpoint(run / "checkpoints" / "checkpoint-000010", 10, {"eval_loss": 2.0}, None)
    record.add_checkpoint(run / "checkpoints" / "checkpoint-000020", 20, {"eval_loss": 1.5}, None)
    record.set_status("completed")
    data = RunRecord.load(run).data
    assert [c["step"] for c in data["checkpoints"]] == [10, 20]
    assert data["step"] == 20 and data["status"] == "completed"
    assert not list(run.glob(".run.json*"))  # no temp files left behind


def test_find_run_newest_by_number_and_ambiguity(tmp_path):
    out = tmp_path / "output"
    a1 = make_run(out / "a", tmp_path, "a.yaml")
    make_run(out / "b", tmp_path, "b.yaml")
    b2 = make_run(out / "b", tmp_path, "b.yaml")
    assert find_run(out) == b2
    with pytest.raises(RunError, match="several configs"):
        find_run(out, number=1)
    assert find_run(out, number=1, config_name="a.yaml") == a1
    with pytest.raises(RunError, match="no run number 7"):
        find_run(out, number=7)
    with pytest.raises(RunError, match="not a forge run"):
        find_run(out, run_dir=tmp_path)


def test_no_runs_is_a_clear_error(tmp_path):
    with pytest.raises(RunError, match="forge train"):
        find_run(tmp_path / "output")
