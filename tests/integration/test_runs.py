"""A run's directory, its tables, damaged checkpoints, random kills, and HF loading."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_forge
from tests.integration.conftest import SMALL
from tests.integration.test_train_resume import start_forge, wait_for

pytestmark = pytest.mark.integration


def test_run_directory_layout(trained_once):
    project, run_dir, result = trained_once
    assert run_dir == project / "output" / "train" / "run_001"
    assert result.stdout.splitlines()[0] == str(run_dir)  # the run dir is printed first
    for name in ("config.yaml", "run.json", "metrics.jsonl", "tb", "checkpoints"):
        assert (run_dir / name).exists(), name
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed"
    assert record["run"] == 1 and record["config"] == "train.yaml"
    assert record["step"] == 40
    assert [c["step"] for c in record["checkpoints"]] == [10, 20, 30, 40]
    assert "torch" in record["versions"]
    assert "-D" not in record["overrides"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) >= 8
    assert any("eval_loss" in m for m in metrics)
    assert "max_steps: 40" in (run_dir / "config.yaml").read_text()


def test_runs_and_checkpoints_tables(trained_once):
    project, run_dir, _ = trained_once
    runs = run_forge("runs", "-p", str(project))
    assert runs.returncode == 0, runs.stderr
    assert "train/run_001" in runs.stdout and "completed" in runs.stdout
    header, row = runs.stdout.splitlines()[:2]
    on_disk = len(list((run_dir / "checkpoints").glob("checkpoint-*")))
    assert on_disk == 3  # save_total_limit: 3 of the 4 saved are kept
    assert row.split()[header.split().index("CKPTS")] == str(on_disk)
    ckpts = run_forge("checkpoints", "-p", str(project), "--verify")
    assert ckpts.returncode == 0, ckpts.stderr
    assert "checkpoint-000040" in ckpts.stdout and "INVALID" not in ckpts.stdout


def test_second_train_gets_the_next_run_number(trained):
    project, _, _ = trained
    result = run_forge("train", "-p", str(project), *SMALL, "-D", "max_steps=2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].endswith("run_002")


def test_damaged_newest_checkpoint_is_skipped_naming_the_file(trained):
    project, run_dir, _ = trained
    weights = run_dir / "checkpoints" / "checkpoint-000040" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    table = run_forge("checkpoints", "-p", str(project), "--verify")
    assert table.returncode == 1
    assert "INVALID" in table.stdout and "model.safetensors" in table.stdout
    resumed = run_forge("resume", "-p", str(project), "--set", "trainer.args.max_steps=42")
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoint-000040" in resumed.stderr and "model.safetensors" in resumed.stderr
    assert "checkpoint-000030" in resumed.stderr  # resumed from the newest valid one


def test_resume_without_checkpoint_exits_1_and_changes_nothing(project):
    result = run_forge("train", "-p", str(project), *SMALL, "-D", "max_steps=3")
    assert result.returncode == 0, result.stderr
    run_dir = Path(result.stdout.splitlines()[0])
    for ckpt in (run_dir / "checkpoints").iterdir():
        (ckpt / "manifest.json").unlink()
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if not p.name.startswith(".lock")}
    resumed = run_forge("resume", "-p", str(project))
    assert resumed.returncode == 1
    assert "no valid checkpoint" in resumed.stderr
    assert {
        p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if not p.name.startswith(".lock")
    } == before


def test_training_state_with_pickled_code_is_refused(trained):
    project, run_dir, _ = trained
    path = run_dir / "checkpoints" / "checkpoint-000040" / "trainer.pt"
    torch.save({"hook": print}, path)  # weights_only refuses callables
    from forge.checkpoint import CheckpointError, load_torch_state

    with pytest.raises(CheckpointError, match="refusing to load"):
        load_torch_state(path)


def test_from_pretrained_matches_the_trainers_model(trained_once):
    from transformers import AutoModelForCausalLM

    from forge.checkpoint import load_model_weights
    from forge.config import load_project, parse_config

    project, run_dir, _ = trained_once
    ckpt = run_dir / "checkpoints" / "checkpoint-000040"
    hf_model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    cfg = parse_config((run_dir / "config.yaml").read_text(), project=load_project(project))
    model_init = cfg.build(
        "model", {"run_dir": str(run_dir), "output_root": str(project / "output")}
    )
    model = model_init()
    load_model_weights(model, ckpt)
    model.eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf_model(ids).logits, model(ids).logits)


def test_generate_from_a_run_directory(trained_once):
    _, run_dir, _ = trained_once
    result = run_forge("generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")


@pytest.mark.slow  # fast representative: tests/reliability/test_kills.py (a random kill)
def test_sigkill_at_random_moments_always_leaves_a_resumable_run(project):
    rng = random.Random(1234)
    args = [*SMALL, "-D", "save_steps=2", "-D", "max_steps=400"]
    proc = start_forge("train", "-p", str(project), *args, cwd=REPO)
    run_dir = Path(proc.stdout.readline().strip())
    wait_for(run_dir / "checkpoints" / "checkpoint-000002", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(4):
        resume = start_forge("resume", "-p", str(project), "--run-dir", str(run_dir), cwd=REPO)
        time.sleep(rng.uniform(3.0, 8.0))
        resume.send_signal(signal.SIGKILL)
        resume.wait()
        table = run_forge("checkpoints", "-p", str(project), "--verify")
        assert table.returncode == 0, table.stdout + table.stderr
    final = run_forge(
        "resume",
        "-p",
        str(project),
        "--run-dir",
        str(run_dir),
        "--set",
        "trainer.args.max_steps=10",
    )
    assert final.returncode == 0, final.stderr


def test_bad_training_argument_exits_2_and_leaves_no_run(project):
    result = run_forge("train", "-p", str(project), *SMALL, "-D", "save_steps=0")
    assert result.returncode == 2
    assert (
        "train.yaml:17: .trainer_args.save_steps: trainer.args.save_steps must be a positive"
        in (result.stderr)
    )  # found by the config check, at the template line that wrote it
    assert "Traceback" not in result.stderr
    assert not (project / "output" / "train" / "run_001").exists()


def test_a_metric_the_evaluation_does_not_produce_is_refused_before_the_run_exists(
    project, tmp_path
):
    """The sanity pass evaluates before training: a misspelled metric_for_best_model fails in
    seconds, at its line, and no run is created (it used to fail at the step-2 evaluation,
    after training)."""
    results = tmp_path / "results"  # an HF port's own output_dir, outside the run directory
    result = run_forge(
        "train", "-p", str(project), *SMALL,
        "-D", "max_steps=4", "-D", "eval_steps=2", "-D", "logging_steps=1",
        "--set", f"trainer.args.output_dir={results}",
        "--set", "trainer.args.metric_for_best_model=eval_acuracy",
    )  # fmt: skip
    assert result.returncode == 2
    assert "metric_for_best_model is 'eval_acuracy', but the evaluation before training" in (
        result.stderr
    )
    assert "--set trainer.args.metric_for_best_model=eval_acuracy" in result.stderr
    assert not (project / "output" / "train" / "run_001").exists()
    assert not (results / "metrics.jsonl").exists()


def test_sigterm_is_acknowledged_at_once_and_a_complete_run_has_nothing_to_resume(project):
    proc = start_forge("train", "-p", str(project), *SMALL, "-D", "max_steps=400", cwd=REPO)
    run_dir = Path(proc.stdout.readline().strip())
    wait_for(run_dir / "checkpoints" / "checkpoint-000010", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    said = stderr.index("received SIGTERM: saving a checkpoint at the next step")
    stopped = re.search(r"stopped by SIGTERM at step (\d+)", stderr)
    if int(stopped.group(1)) > 10:  # acknowledged before the save the stop makes
        assert said < stderr.index("saved checkpoint", stderr.index("checkpoint-000010") + 1)
    else:  # the signal landed on step 10, already saved: nothing more to save
        assert said < stopped.start() and "checkpoint-000010 holds it" in stderr
    # a busy machine may run many steps before the signal lands: finish 10 steps after the stop
    end = int(stopped.group(1)) + 10
    finished = run_forge(
        "resume", "-p", str(project), "--set", f"trainer.args.max_steps={end}", cwd=REPO
    )
    assert finished.returncode == 0, finished.stderr
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if not p.name.startswith(".lock")}
    again = run_forge("resume", "-p", str(project), cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert f"run_001 is complete (step {end} of {end}); nothing to do" in again.stderr
    assert again.stdout == ""
    assert {
        p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if not p.name.startswith(".lock")
    } == before


def test_a_kill_between_a_commit_and_run_json_is_invisible(trained):
    """run.json put back to what it held just before checkpoint-000040's commit (the window
    of a SIGKILL after the rename, before the record's update): the tables, --best and the
    `best` link follow the committed manifests."""
    from forge.runs import best_checkpoint

    project, run_dir, _ = trained
    ckpts = run_dir / "checkpoints"
    newest = json.loads((ckpts / "checkpoint-000040" / "manifest.json").read_text())
    best = newest["best"]  # the run's best as of that commit
    assert best["metric"] == "eval_loss" and best["value"] == min(
        json.loads((ckpts / name / "manifest.json").read_text())["metrics"]["eval_loss"]
        for name in ("checkpoint-000020", "checkpoint-000040")
    )
    record = json.loads((run_dir / "run.json").read_text())
    earlier = [c for c in record["checkpoints"] if c["step"] < 40]
    stale = {"checkpoint": "checkpoints/checkpoint-000030", "metric": "eval_loss", "value": 9.5}
    record.update(status="running", step=30, checkpoints=earlier, best=stale)
    (run_dir / "run.json").write_text(json.dumps(record))
    shutil.rmtree(run_dir / "best")  # the fixture's copy made the link a directory
    (run_dir / "best").symlink_to("checkpoints/checkpoint-000030")

    runs = run_forge("runs", "-p", str(project))
    assert runs.returncode == 0, runs.stderr
    header, row = (line.split() for line in runs.stdout.splitlines()[:2])
    assert row[header.index("STEP")] == "40"
    assert row[header.index("BEST")] == f"eval_loss={best['value']:.4g}"
    assert best_checkpoint(run_dir) == (ckpts / best["checkpoint"]).resolve()
    assert (run_dir / "best").resolve() == (ckpts / best["checkpoint"]).resolve()
    repaired = json.loads((run_dir / "run.json").read_text())  # no process trains it
    assert repaired["step"] == 40 and repaired["best"]["value"] == best["value"]
    assert repaired["checkpoints"][-1]["metrics"] == newest["metrics"]


def test_checkpoints_of_a_run_dir_find_its_project_without_p(trained_once, tmp_path):
    project, run_dir, _ = trained_once
    result = run_forge("checkpoints", "--run-dir", str(run_dir), cwd=tmp_path)  # no project here
    assert result.returncode == 0, result.stderr
    assert "train/run_001/checkpoints/checkpoint-000040" in result.stdout


def _damage_final_weights(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Flip the last byte of checkpoint-000040's weights; the weights as they were.

    They are read from the bytes, not with ``load_file``: its tensors map the file, so the
    damage written in place would show through them."""
    from safetensors.torch import load

    weights = run_dir / "checkpoints" / "checkpoint-000040" / "model.safetensors"
    final = load(weights.read_bytes())
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return weights, final


def test_export_of_a_completed_run_with_damaged_final_weights_says_how_to_rebuild(trained):
    project, run_dir, _ = trained
    _damage_final_weights(run_dir)
    result = run_forge("export", str(run_dir), str(run_dir.parent / "out"))
    assert result.returncode == 1, result.stderr
    assert "its final weights (checkpoint-000040) are damaged" in result.stderr
    assert f"forge resume -p {project} --run-dir {run_dir}` rebuilds them" in result.stderr
    assert "training again from checkpoint-000030" in result.stderr
    assert not (run_dir.parent / "out").exists()
    given = run_dir / "checkpoints" / "checkpoint-000030"  # named: the earlier weights export
    assert run_forge("export", str(given), str(run_dir.parent / "out")).returncode == 0


def test_a_resume_from_a_named_earlier_checkpoint_finds_no_damage(trained, caplog):
    """`forge resume --from` an earlier checkpoint of a completed run: the final weights are
    sound, and the resume says nothing of damage (it once said they were damaged); a resume
    whose newest valid checkpoint discovery chose, with the final save damaged, still says so."""
    from forge.config import load_project
    from forge.launch.start import plan_resume

    project, run_dir, _ = trained
    earlier = run_dir / "checkpoints" / "checkpoint-000030"
    with caplog.at_level("WARNING", logger="forge"):
        plan = plan_resume(load_project(project), run_dir, from_checkpoint=earlier)
        assert plan.done is None and plan.checkpoint.path == earlier
        assert "damaged" not in caplog.text
        _damage_final_weights(run_dir)
        plan = plan_resume(load_project(project), run_dir)
    assert plan.checkpoint.path == earlier
    assert "its final weights (checkpoint-000040) are damaged" in caplog.text


@pytest.mark.slow  # trains the last 10 steps again
def test_resume_of_a_completed_run_with_damaged_final_weights_rebuilds_them(trained):
    from safetensors.torch import load_file

    project, run_dir, _ = trained
    weights, final = _damage_final_weights(run_dir)
    resumed = run_forge("resume", "-p", str(project))
    assert resumed.returncode == 0, resumed.stderr
    assert "is complete" not in resumed.stderr
    assert "final weights (checkpoint-000040) are damaged" in resumed.stderr
    assert "resuming from checkpoint-000030 rebuilds them" in resumed.stderr
    assert run_forge("checkpoints", "-p", str(project), "--verify").returncode == 0
    rebuilt = load_file(weights)
    assert rebuilt.keys() == final.keys()
    for name, tensor in final.items():  # trained again from step 30: the same weights, bitwise
        assert torch.equal(rebuilt[name], tensor), name
