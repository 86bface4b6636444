"""`forge sweep` through the real entry point: trials are ordinary runs, bad input is refused
before any trial runs, a SIGKILLed sweep continues exactly, workers never collide, studies
prune and beat the defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge.cli import main
from tests.helpers import REPO, run_forge

SHORT = ["-D", "max_steps=6", "-D", "eval_steps=3", "-D", "save_steps=3", "-D", "logging_steps=1"]
SHORT += ["-D", "report_to=none"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    parent = tmp_path_factory.mktemp("sweep")
    assert run_forge("new", "cls", "--from", "classifier", "-p", str(parent)).returncode == 0
    return parent / "cls"


def fresh(project: Path, tmp_path: Path) -> Path:
    """A copy of the scaffold with no output, for a test that trains."""
    import shutil

    target = tmp_path / "cls"
    shutil.copytree(project, target, ignore=shutil.ignore_patterns("output"))
    return target


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """The metric at each step; a step logged twice (before and after a resume) keeps its last."""
    found = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            found[row["step"]] = row[key]
    return found


def trials(project: Path) -> list[dict]:
    (sweep,) = [p for p in (project / "output" / "sweeps").iterdir() if p.name != "pruned"]
    return [json.loads(p.read_text()) for p in sorted((sweep / "trials").glob("*.json"))]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-D", "learning_rat=1e-3,1e-2"], "did you mean 'learning_rate'"),
        (["-D", "learning_rate=loguniform(1e-2,1e-4)"], "LOW must be below HIGH"),
        (["-D", "learning_rate=1e-3,"], "an empty value"),
        (["-D", "learning_rate=loguniform(1e-4,1e-2)", "--method", "grid"], "grid takes lists"),
        (["-D", "learning_rate=1e-3,1e-2", "--objective", "eval_los"], "did you mean 'eval_loss'"),
        (
            ["-D", "learning_rate=1e-3,1e-2", "--objective", "eval_accuracy", "--direction", "max"],
            "logs eval_loss only",
        ),
        (["-D", "learning_rate=1e-3,1e-2", "--objective", "grad_norm"], "--direction"),
        (["-D", "learning_rate=1e-3,1e-2", "--trials", "5"], "a grid has 2 points"),
        (["-D", "learning_rate=1e-3,1e-2", "--pruner", "median"], "pruning needs a study"),
        (["-D", "hidden_size=int(8,64)", "--pruner", "medain"], "did you mean 'median'"),
        (["-D", "hidden_size=int(8,64)", "--method", "tpee"], "did you mean 'tpe'"),
        ([], "nothing to sweep"),
    ],
)
def test_bad_input_is_refused_before_any_trial(project, capsys, argv, says):
    code = main(["sweep", "train", "-p", str(project), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err
    assert "Traceback" not in err
    assert not (project / "output").exists()  # nothing ran, nothing was written


def test_a_study_without_optuna_names_the_pip_command(project, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    code = main(["sweep", "train", "-p", str(project), "-D", "hidden_size=int(8,64)"])
    assert code == 2
    assert "pip install 'forge[sweep]'" in capsys.readouterr().err


def test_a_sweep_of_another_config_or_search_is_refused(project, tmp_path, capsys):
    from forge.config import load_project
    from forge.sweep.space import SweepSpec, parse_axis
    from forge.sweep.study import open_sweep

    target = fresh(project, tmp_path)
    configs = target / "templates" / "configs"
    (configs / "other.yaml").write_text((configs / "train.yaml").read_text())
    output = load_project(target).output_dir
    open_sweep(output, SweepSpec("other.yaml", [parse_axis("hidden_size", "8,16")]), "s", 2)
    base = ["sweep", "-p", str(target), "--name", "s", "-D", "hidden_size=8,16"]
    assert main([*base[:1], "train", *base[1:]]) == 2
    assert "is a sweep of config 'other.yaml', not 'train.yaml'" in capsys.readouterr().err
    assert main([*base[:1], "other", *base[1:-1], "hidden_size=8,32"]) == 2
    assert "searches another space: its axes" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_a_slurm_array_script(project, capsys):
    argv = ["sweep", "train", "-p", str(project), "-D", "learning_rate=1e-3,3e-3"]
    argv += ["-D", "hidden_size=32,64", "--jobs", "2", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "4 trial(s), grid, minimize eval_loss" in out
    assert "3  learning_rate=0.003 hidden_size=64" in out
    assert "#SBATCH --array=0-3%2" in out
    assert "--one-trial" in out.splitlines()[-1] and "-D learning_rate=1e-3,3e-3" in out
    assert not (project / "output").exists()


# --------------------------------------------------------------------------- trials as runs


def test_a_grid_gives_ordinary_runs_equal_to_forge_train(project, tmp_path):
    target = fresh(project, tmp_path)
    swept = run_forge("sweep", "train", "-p", str(target), "-D", "learning_rate=1e-3,3e-3", *SHORT)
    assert swept.returncode == 0, swept.stderr
    runs = target / "output" / "train"
    assert sorted(p.name for p in runs.iterdir()) == ["run_001", "run_002"]
    record = json.loads((runs / "run_002" / "run.json").read_text())
    assert record["status"] == "completed"
    assert record["sweep"]["trial"] == 1 and record["sweep"]["params"] == {"learning_rate": 3e-3}
    assert record["variables"]["learning_rate"] == 3e-3
    trained = run_forge("train", "-p", str(target), "-D", "learning_rate=3e-3", *SHORT)
    assert trained.returncode == 0, trained.stderr
    alone = runs / "run_003"
    assert losses(runs / "run_002") == losses(alone)
    assert losses(runs / "run_002", "eval_loss") == losses(alone, "eval_loss")

    shown = run_forge("sweep", "show", "-p", str(target))
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines()[2:4]]
    values = [float(row[1]) for row in rows]
    assert values == sorted(values) and {row[2] for row in rows} == {"completed"}
    best_trial = rows[0][0]
    assert f"best: trial {best_trial}" in shown.stdout
    (sweep,) = (target / "output" / "sweeps").iterdir()
    best_run = runs / f"run_00{int(best_trial) + 1}"
    assert (sweep / "best").resolve() == best_run.resolve()

    listed = run_forge("runs", "-p", str(target))
    assert listed.stdout.count("completed") == 3
    if pytest.importorskip("matplotlib"):
        plotted = run_forge("sweep", "plot", "-p", str(target))
        assert plotted.returncode == 0, plotted.stderr
        assert Path(plotted.stdout.strip()).stat().st_size > 1000


def test_a_trial_with_loader_workers_trains_as_forge_train_does(project, tmp_path):
    """A trial is forked from the fork server; its loader workers are forked from the trial,
    as a fresh process's are. Started through the fork server, they could not unpickle the
    project's dataset (every trial failed: "DataLoader worker ... exited unexpectedly")."""
    target = fresh(project, tmp_path)
    workers = ["--set", "trainer.args.dataloader_num_workers=2"]
    swept = run_forge(
        "sweep", "train", "-p", str(target), "-D", "learning_rate=3e-3,1e-3", *SHORT, *workers
    )
    assert swept.returncode == 0, swept.stderr[-3000:]
    assert [record["status"] for record in trials(target)] == ["completed", "completed"]
    trained = run_forge("train", "-p", str(target), "-D", "learning_rate=3e-3", *SHORT, *workers)
    assert trained.returncode == 0, trained.stderr[-3000:]
    runs = target / "output" / "train"
    assert losses(runs / "run_001") == losses(runs / "run_003")


@pytest.mark.slow
def test_a_failed_trial_is_recorded_and_the_sweep_goes_on(project, tmp_path):
    target = fresh(project, tmp_path)
    swept = run_forge("sweep", "train", "-p", str(target), "-D", "dropout=2.0,0.0", *SHORT)
    assert swept.returncode == 0, swept.stderr
    failed, completed = trials(target)
    assert failed["status"] == "failed" and "dropout" in failed["error"]
    assert completed["status"] == "completed"
    shown = run_forge("sweep", "show", "-p", str(target))
    assert "trial 0 failed" in shown.stderr


# --------------------------------------------------------------------------- resuming


def _sweep_process(project: Path, *argv: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "forge.cli", "sweep", "train", "-p", str(project), *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_sigkill_then_the_same_command_continues_exactly(project, tmp_path):
    target = fresh(project, tmp_path)
    argv = ["-D", "learning_rate=3e-3,1e-3", "-D", "max_steps=150", "-D", "save_steps=10"]
    argv += ["-D", "eval_steps=50", "-D", "logging_steps=1", "-D", "report_to=none"]
    sweep = _sweep_process(target, *argv)
    first = target / "output" / "train" / "run_001"
    deadline = time.monotonic() + 120
    while not (first / "checkpoints" / "checkpoint-000020").is_dir():
        assert sweep.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    sweep.kill()  # SIGKILL, as users do
    sweep.wait()
    from forge.runs import run_is_live

    deadline = time.monotonic() + 10
    while run_is_live(first):  # its training process dies with it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(trials(target)) == 1 and trials(target)[0]["status"] == "running"
    shown = run_forge("sweep", "show", "-p", str(target))
    assert " interrupted " in shown.stdout  # no process holds its run: the sweep was killed

    again = run_forge("sweep", "train", "-p", str(target), *argv)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr
    records = trials(target)
    assert [r["status"] for r in records] == ["completed", "completed"]
    runs = target / "output" / "train"
    assert sorted(p.name for p in runs.iterdir()) == ["run_001", "run_002"]  # none run twice
    assert json.loads((first / "run.json").read_text())["resumes"]
    reference = run_forge("train", "-p", str(target), "-D", "learning_rate=3e-3", *argv[2:])
    assert reference.returncode == 0, reference.stderr
    assert losses(first) == losses(runs / "run_003")  # bitwise, every step
    assert len(losses(first)) == 150


@pytest.mark.slow
def test_workers_at_once_never_collide(project, tmp_path):
    target = fresh(project, tmp_path)
    argv = ["-D", "learning_rate=uniform(0.001,0.01)", "--method", "random", "--trials", "5"]
    argv += [*SHORT]
    workers = [_sweep_process(target, *argv), _sweep_process(target, *argv, "--jobs", "2")]
    for worker in workers:
        _, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
    records = trials(target)
    assert [r["trial"] for r in records] == [0, 1, 2, 3, 4]
    assert {r["status"] for r in records} == {"completed"}
    assert len({r["run_dir"] for r in records}) == 5
    for record in records:
        field = json.loads((Path(record["run_dir"]) / "run.json").read_text())["sweep"]
        assert field["trial"] == record["trial"]


# --------------------------------------------------------------------------- studies


@pytest.mark.slow
def test_a_study_beats_the_defaults_and_pruning_shows(project, tmp_path):
    pytest.importorskip("optuna")
    target = fresh(project, tmp_path)
    budget = ["-D", "max_steps=20", "-D", "eval_steps=10", "-D", "save_steps=10"]
    budget += ["-D", "report_to=none"]
    default = run_forge("train", "-p", str(target), *budget)
    assert default.returncode == 0, default.stderr
    baseline = losses(target / "output" / "train" / "run_001", "eval_loss")[20]
    argv = ["-D", "learning_rate=loguniform(1e-3,3e-2)", "-D", "hidden_size=int(32,256)"]
    study = run_forge("sweep", "train", "-p", str(target), *argv, "--trials", "6", *budget)
    assert study.returncode == 0, study.stderr
    values = [r["value"] for r in trials(target) if r["status"] == "completed"]
    print(f"defaults: eval_loss {baseline:.4f}; study's best {min(values):.4f} of {values}")
    assert min(values) < baseline

    pruned = run_forge(
        "sweep", "train", "-p", str(target), *argv, "--trials", "2", "--name", "pruned",
        "--pruner", "threshold(upper=0.01)", *budget, "-D", "eval_steps=5",
    )  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    assert "pruned at step 5" in pruned.stderr  # no save was due at step 5: pruning saved
    shown = run_forge("sweep", "show", "pruned", "-p", str(target))
    assert shown.stdout.count(" pruned ") == 2
    sweep = target / "output" / "sweeps" / "pruned"
    for path in (sweep / "trials").glob("*.json"):
        run_dir = Path(json.loads(path.read_text())["run_dir"])
        record = json.loads((run_dir / "run.json").read_text())
        assert record["status"] == "pruned" and record["step"] == 5
        assert (run_dir / "checkpoints" / "checkpoint-000005").is_dir()


@pytest.mark.slow
def test_one_trial_is_a_worker_that_takes_the_next_trial(project, tmp_path):
    """What each task of the --dry-run's SLURM array runs."""
    target = fresh(project, tmp_path)
    argv = ["sweep", "train", "-p", str(target), "-D", "learning_rate=1e-3,3e-3", *SHORT]
    for expected in ([0], [0, 1], [0, 1]):
        worker = run_forge(*argv, "--one-trial")
        assert worker.returncode == 0, worker.stderr
        assert [r["trial"] for r in trials(target)] == expected
    assert {r["status"] for r in trials(target)} == {"completed"}


def test_a_sweep_whose_trials_all_failed_fails():
    """No trial completed: exit 1 naming a trial's error (a script's `forge export best` after
    it would find nothing); one trial failed of several that completed: the sweep succeeds;
    a worker whose own trials all failed (a SLURM array task) fails."""
    from forge.cli.exits import RuntimeFailure
    from forge.cli.sweep import refuse_all_failed

    failed = {"trial": 0, "status": "failed", "error": "dropout 2.0", "run_dir": "run_001"}
    completed = {"trial": 1, "status": "completed", "value": 0.5, "run_dir": "run_002"}
    with pytest.raises(RuntimeFailure, match="every trial of sweep s .* failed .*dropout 2.0"):
        refuse_all_failed("s", [failed], [failed])
    refuse_all_failed("s", [failed, completed], [failed, completed])
    refuse_all_failed("s", [failed, completed], [completed])
    with pytest.raises(RuntimeFailure, match="this process trained failed"):
        refuse_all_failed("s", [failed, completed], [failed])


@pytest.mark.slow
def test_a_sweep_of_failed_trials_exits_1(project, tmp_path):
    target = fresh(project, tmp_path)
    swept = run_forge("sweep", "train", "-p", str(target), "-D", "dropout=2.0,3.0", *SHORT)
    assert swept.returncode == 1, swept.stderr
    assert "every trial of sweep" in swept.stderr and "dropout" in swept.stderr
    assert "Traceback" not in swept.stderr
    assert [r["status"] for r in trials(target)] == ["failed", "failed"]
