"""`forge code`: a standalone script that trains exactly as `forge train` does."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.small_lm import SMALL_LM, defines
from tests.helpers import TINY_LM, run_forge

TRAINING = {"batch_size": 4, "eval_steps": 5, "save_steps": 5, "warmup_steps": 2}


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m[key]) for m in map(json.loads, lines) if key in m]


def run_script(script: Path, output_dir: Path) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, str(script), "--output-dir", str(output_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=output_dir.parent,
    )


def train_both_ways(project: Path, *args: str, tmp_path: Path) -> tuple[Path, Path]:
    """`forge train` and the `forge code` script of the same config; their run directories."""
    trained = run_forge("train", "-p", str(project), *args)
    assert trained.returncode == 0, trained.stderr
    script = tmp_path / "train_script.py"
    coded = run_forge("code", "-p", str(project), *args, "-o", str(script))
    assert coded.returncode == 0, coded.stderr
    ran = run_script(script, tmp_path / "script_run")
    assert ran.returncode == 0, ran.stderr
    return Path(trained.stdout.splitlines()[0]), tmp_path / "script_run"


def assert_same_curves(forge_run: Path, script_run: Path, steps: int) -> None:
    for key in ("loss", "eval_loss"):
        ours, theirs = logged(forge_run, key), logged(script_run, key)
        assert [s for s, _ in ours] == [s for s, _ in theirs], key
        assert ours and all(
            abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(ours, theirs, strict=True)
        ), key
    assert logged(forge_run, "loss")[-1][0] == steps


@pytest.fixture
def lm_project(tmp_path):
    dest = tmp_path / "tiny_lm"
    shutil.copytree(TINY_LM, dest, ignore=shutil.ignore_patterns("output"))
    return dest


def test_script_trains_the_small_lm_with_the_same_losses(lm_project, tmp_path):
    args = [*defines(SMALL_LM | TRAINING), "-D", "max_steps=10", "-D", "logging_steps=1"]
    forge_run, script_run = train_both_ways(lm_project, *args, tmp_path=tmp_path)
    assert_same_curves(forge_run, script_run, steps=10)
    assert (script_run / "checkpoints" / "checkpoint-000010" / "manifest.json").is_file()


@pytest.mark.slow
def test_script_of_a_project_with_its_own_files_trains_the_same(tmp_path):
    assert run_forge("new", "cls", "--from", "classifier", "-p", str(tmp_path)).returncode == 0
    args = ["-D", "max_steps=30", "-D", "logging_steps=5", "-D", "eval_steps=15"]
    forge_run, script_run = train_both_ways(tmp_path / "cls", *args, tmp_path=tmp_path)
    assert_same_curves(forge_run, script_run, steps=30)


def test_script_is_plain_python_without_the_config_layer(tmp_path):
    assert run_forge("new", "cls", "--from", "classifier", "-p", str(tmp_path)).returncode == 0
    result = run_forge("code", "-p", str(tmp_path / "cls"), "--set", "trainer.args.seed=7")
    assert result.returncode == 0, result.stderr
    tree = ast.parse(result.stdout)
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not any(name and name.startswith("forge.config") for name in imported), imported
    assert {"forge.train", "model", "data", "functools"} <= imported
    assert "seed=7" in result.stdout  # --set reaches the script
    assert "functools.partial(\n        MLPClassifier," in result.stdout  # model_init stays lazy
    assert "--set trainer.args.seed=7" in result.stdout  # how it was generated


def test_shared_objects_are_built_once_and_factories_anew(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: p\n")
    (tmp_path / "templates" / "configs" / "c.yaml").write_text(
        "shared: &shared !singleton:builtins:dict {a: 1}\n"
        "fresh: &fresh !factory:builtins:list [[1, 2]]\n"
        "trainer: !tuple [*shared, *shared, *fresh, *fresh, !var {name: rank, default: 0}]\n"
    )
    result = run_forge("code", "c", "-p", str(tmp_path))
    assert result.returncode == 0, result.stderr
    namespace: dict = {"__name__": "generated"}
    exec(compile(result.stdout, "generated", "exec"), namespace)
    built = namespace["build_trainer"]()
    assert built[0] is built[1] and built[0] == {"a": 1}
    assert built[2] == built[3] == [1, 2] and built[2] is not built[3]
    assert built[4] == 0  # RANK is unset in this process


def test_code_of_a_broken_config_exits_2(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: p\n")
    (tmp_path / "templates" / "configs" / "c.yaml").write_text(
        "trainer: !singleton:torch.optim:AdamWW {}\n"
    )
    result = run_forge("code", "c", "-p", str(tmp_path))
    assert result.returncode == 2
    assert "AdamW" in result.stderr and result.stdout == ""


@pytest.mark.slow
def test_script_of_the_default_tiny_lm_matches_forge_train(lm_project, tmp_path):
    args = ["-D", "max_steps=10", "-D", "logging_steps=1"]
    forge_run, script_run = train_both_ways(lm_project, *args, tmp_path=tmp_path)
    assert_same_curves(forge_run, script_run, steps=10)
