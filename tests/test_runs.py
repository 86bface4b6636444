"""Run directories: numbering, records, and finding the run to resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from forge.runs import (
    RunBusyError,
    RunError,
    RunRecord,
    all_run_dirs,
    checkpoint_count,
    claim_run,
    configured_max_steps,
    create_run,
    discard_unstarted_run,
    find_run,
    hold_training_lock,
    list_run_dirs,
    nothing_to_resume,
    parse_run_config,
    run_is_live,
    stale_running_note,
)
from tests.helpers import REPO


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


def test_checkpoint_count_skips_rotated_checkpoints(tmp_path):
    run = make_run(tmp_path / "c", tmp_path)
    record = RunRecord.load(run)
    for step in (10, 20, 30):
        path = run / "checkpoints" / f"checkpoint-{step:06d}"
        path.mkdir(parents=True)
        record.add_checkpoint(path, step, {}, None)
    shutil.rmtree(run / "checkpoints" / "checkpoint-000010")  # as rotation does
    assert len(RunRecord.load(run).data["checkpoints"]) == 3
    assert checkpoint_count(run) == 2


def test_a_committed_checkpoint_run_json_does_not_record_yet_is_counted(tmp_path):
    """A run killed after a background commit ended, before the step that records it in
    run.json: forge runs shows the checkpoint and the step it reaches."""
    import torch

    from forge.checkpoint import CheckpointWriter
    from forge.runs import newest_step

    run = make_run(tmp_path / "c", tmp_path)
    with CheckpointWriter(run / "checkpoints", 10) as writer:
        writer.save_torch("trainer.pt", {"step": torch.tensor(10)})
    (run / "checkpoints" / "checkpoint-000020").mkdir()  # an unfinished one does not count
    data = RunRecord.load(run).data
    assert data.get("checkpoints", []) == [] and int(data.get("step") or 0) == 0
    assert checkpoint_count(run) == 1
    assert newest_step(run, data) == 10


RUN_CONFIG = (
    "trainer: !singleton:builtins:dict\n    args: !singleton:builtins:dict {max_steps: 40}\n"
)


def resumable_run(tmp_path, *, status: str, step: int):
    run = create_run(
        tmp_path / "output" / "train",
        config_name="train.yaml",
        config_text=RUN_CONFIG,
        project_root=tmp_path,
        overrides=[],
        variables={},
        nproc=1,
    )
    RunRecord.load(run).set_status(status, step=step)
    return run, run / "checkpoints" / f"checkpoint-{step:06d}"


def test_configured_max_steps_reads_the_trainer_args(tmp_path):
    run, _ = resumable_run(tmp_path, status="completed", step=40)
    assert configured_max_steps(parse_run_config(run, None)) == 40
    longer = parse_run_config(run, None, ["trainer.args.max_steps=80"])
    assert configured_max_steps(longer) == 80
    assert configured_max_steps(parse_run_config(run, None, ["trainer.args.max_steps=-1"])) is None


def test_a_completed_run_has_nothing_to_resume_unless_it_can_go_further(tmp_path):
    run, checkpoint = resumable_run(tmp_path, status="completed", step=40)
    cfg = parse_run_config(run, None)
    message = nothing_to_resume(run, checkpoint, cfg, changed=False)
    assert message.startswith("run_001 is complete (step 40 of 40); nothing to do")
    longer = parse_run_config(run, None, ["trainer.args.max_steps=80"])
    assert nothing_to_resume(run, checkpoint, longer, changed=True) is None
    other = parse_run_config(run, None, ["trainer.args.max_steps=40"])
    assert nothing_to_resume(run, checkpoint, other, changed=True) is not None


def test_an_interrupted_run_resumes_until_its_last_step(tmp_path):
    run, checkpoint = resumable_run(tmp_path, status="interrupted", step=20)
    cfg = parse_run_config(run, None)
    assert nothing_to_resume(run, checkpoint, cfg, changed=False) is None
    at_end = checkpoint.with_name("checkpoint-000040")
    assert "step 40 of 40" in nothing_to_resume(run, at_end, cfg, changed=False)


# --------------------------------------------------------------------------- damaged records


@pytest.mark.parametrize(
    "text, says",
    [
        ("{", "not valid JSON (Expecting property name"),
        ("[1, 2]", "must be a JSON object (got list)"),
        ('{"step": "12"}', "'step' must be an integer (got \"12\")"),
        ('{"step": true}', "'step' must be an integer (got true)"),
        ('{"status": "flying"}', "'status' must be one of created, running"),
        ('{"checkpoints": [{"step": 10}]}', "'checkpoints' entry 0 must be an object"),
        ('{"best": 3}', "'best' must be an object or null (got 3)"),
        ('{"signal": "SIGFOO"}', "'signal' must name a signal"),
        ('{"resumes": [1]}', "'resumes' must be a list of objects"),
    ],
)
def test_a_damaged_run_record_is_a_located_run_error(tmp_path, text, says):
    run = make_run(tmp_path / "c", tmp_path)
    (run / "run.json").write_text(text)
    with pytest.raises(RunError) as caught:
        RunRecord.load(run)
    message = str(caught.value)
    assert message.startswith(f"{run / 'run.json'}: ")
    assert says in message
    assert "the run record is damaged" in message


def test_a_damaged_record_does_not_stop_listing_the_others(tmp_path):
    first = make_run(tmp_path / "output" / "train", tmp_path)
    second = make_run(tmp_path / "output" / "train", tmp_path)
    (first / "run.json").write_text("[]")
    assert all_run_dirs(tmp_path / "output") == [first, second]


# --------------------------------------------------------------------------- the run lock

HOLD_LOCK = """
import sys, time
from pathlib import Path
from forge.runs import claim_run, hold_training_lock
which = sys.argv[2]
lock = claim_run(Path(sys.argv[1])) if which == "launch" else hold_training_lock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds a run's launch or training lock; yields a starter."""
    started = []

    def start(run_dir, which):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(run_dir), which],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("which", ["launch", "train"])
def test_a_live_run_cannot_be_claimed_and_a_killed_one_can(tmp_path, holder, which):
    run = make_run(tmp_path / "c", tmp_path)
    proc = holder(run, which)
    assert run_is_live(run)
    RunRecord.load(run).set_status("running")
    assert stale_running_note(run) is None
    with pytest.raises(RunBusyError) as caught:
        claim_run(run)
    message = str(caught.value)
    assert f"run_001 is being trained right now (pid {proc.pid} on " in message
    assert "kill -TERM PID" in message and str(run) in message

    proc.send_signal(signal.SIGKILL)  # the kernel drops its flock with it
    proc.wait()
    assert not run_is_live(run)
    note = stale_running_note(run)
    assert note.startswith("run_001 was left 'running' by a process that is gone")
    with claim_run(run):
        assert run_is_live(run)
        with pytest.raises(RunBusyError):
            claim_run(run)
    assert not run_is_live(run)


FORKED_HOLDER = """
import os, sys, time
from pathlib import Path
from forge.runs import hold_training_lock
lock = hold_training_lock(Path(sys.argv[1]))
child = os.fork()  # a process it starts (a loader worker, say) inherits the locked file
if child == 0:
    time.sleep(600)
    os._exit(0)
print(child, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the holders")
def test_a_lock_held_by_what_a_dead_holder_started_names_it(tmp_path):
    run = make_run(tmp_path / "c", tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKED_HOLDER, str(run)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    child = int(proc.stdout.readline())
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with pytest.raises(RunBusyError) as caught:
            claim_run(run)
        message = str(caught.value)
        assert f"(pid {proc.pid} on " in message and "which has died" in message
        assert f"still running: pid {child} (" in message
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_training_lock_is_taken_again_after_a_restart(tmp_path):
    run = make_run(tmp_path / "c", tmp_path)
    with claim_run(run):  # the launcher keeps its lock across the workers' restarts
        first = hold_training_lock(run)
        with pytest.raises(RunBusyError):
            hold_training_lock(run, wait=0.1)
        first.release()
        hold_training_lock(run, wait=0.1).release()


def test_an_unstarted_run_is_discarded_with_its_lock_files(tmp_path):
    run = make_run(tmp_path / "c", tmp_path)
    with claim_run(run):
        hold_training_lock(run).release()
        assert discard_unstarted_run(run)
    assert not run.exists()


@pytest.mark.parametrize(
    "record",
    [
        {"status": "failed", "reached_step": 25},  # trained, then a config error at an eval
        {"status": "failed", "checkpoints": [{"step": 10, "path": "/elsewhere/checkpoint-10"}]},
        {"status": "failed", "resumes": [{"from": "checkpoint-10"}]},
        {"status": "running"},  # its rank 0 never recorded how it ended
        {"status": "interrupted", "reached_step": 0},
        {"status": "completed", "step": 3},
    ],
)
def test_a_run_that_trained_or_ended_unrecorded_is_never_discarded(tmp_path, record):
    run = make_run(tmp_path / "c", tmp_path)  # only config.yaml and run.json in it
    RunRecord.load(run).update(**record)
    assert not discard_unstarted_run(run)
    assert json.loads((run / "run.json").read_text())["status"] == record["status"]


def test_a_run_a_config_error_stopped_before_its_first_step_is_discarded(tmp_path):
    run = make_run(tmp_path / "c", tmp_path)
    RunRecord.load(run).set_status("failed", error="bad key", error_kind="usage", reached_step=0)
    assert discard_unstarted_run(run)
    assert not run.exists()
    damaged = make_run(tmp_path / "c", tmp_path)
    (damaged / "run.json").write_text("{")
    assert not discard_unstarted_run(damaged) and damaged.exists()  # unreadable: kept


def test_a_streams_position_is_recorded_with_its_checkpoint(tmp_path):
    from forge.runs import stream_position_text

    run = make_run(tmp_path / "s", tmp_path)
    record = RunRecord.load(run)
    path = run / "checkpoints" / "checkpoint-000010"
    path.mkdir(parents=True)
    record.add_checkpoint(path, 10, {}, None, data={"epoch": 2, "shards": 3, "items": 40})
    data = RunRecord.load(run).data
    assert data["checkpoints"][-1]["data"] == {"epoch": 2, "shards": 3, "items": 40}
    assert stream_position_text(data) == "epoch 2, 3 shard(s), 40 item(s)"
    assert stream_position_text({}) == ""
