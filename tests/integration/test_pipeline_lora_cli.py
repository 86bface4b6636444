"""LoRA on the pipeline trainer through `forge train --nproc 2` on tiny_lm: a trained tiny_lm
fine-tuned on 2 stages, killed in a save and continued with `forge resume` bit for bit, its
adapter checkpoint merged by `forge export --merge-lora`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.small_lm import SMALL_LM, defines
from tests.faults import fault_env
from tests.helpers import REPO, run_forge
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration

#: tiny_lm's lora.yaml with the pipeline trainer
CONFIG = """\
-- extends 'configs/lora.yaml'
-- from 'trainers/pipeline_trainer.yaml' import trainer_class, trainer_args_class, trainer_kind, pipeline_args
-- block trainer_args
    == super()
== pipeline_args()
-- endblock
"""
SETTINGS = {"logging_steps": 2, "eval_steps": 4, "report_to": "none", "max_steps": 8}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """tiny_lm with a trained base (2 steps) and the pipeline LoRA config."""
    project = tmp_path_factory.mktemp("p") / "tiny_lm"
    shutil.copytree(REPO / "projects" / "tiny_lm", project, ignore=shutil.ignore_patterns("output"))
    (project / "templates" / "configs" / "lora_pipeline.yaml").write_text(CONFIG)
    base = run_forge(
        "train", "-p", str(project), *defines(SMALL_LM | {"report_to": "none"}),
        "-D", "max_steps=2", "-D", "save_steps=2",
    )  # fmt: skip
    assert base.returncode == 0, base.stderr
    return project


def tune(project: Path, *extra: str, env: dict | None = None):
    data = {k: SMALL_LM[k] for k in ("block_size", "max_files")}  # the model is the base's
    base = project / "output" / "train" / "run_001"
    return run_forge(
        "train", "lora_pipeline", "-p", str(project), "--nproc", "2",
        *defines(data | SETTINGS), "-D", f"base_model={base}", "-D", "save_steps=2", *extra,
        env=env, timeout=900,
    )  # fmt: skip


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"checkpoint-{step:06d}"


def optimizer_state(ckpt: Path) -> dict:
    files = json.loads((ckpt / "manifest.json").read_text())["components"]["optimizer"]["files"]
    merged: dict = {}
    for name in files:
        merged.update(torch.load(ckpt / name, weights_only=True)["state"])
    return merged


@pytest.mark.slow
def test_two_stages_killed_in_a_save_resume_bit_identical_and_export_merged(project, tmp_path):
    straight = tune(project)
    assert straight.returncode == 0, straight.stderr
    straight_dir = Path(straight.stdout.splitlines()[0])
    # rank 0 SIGKILLs itself in the step-6 save, right after writing the gathered adapter
    died = tune(project, env=fault_env(kill="after:adapter_model.safetensors@6:0"))
    assert died.returncode != 0
    run_dir = Path(died.stdout.splitlines()[0])
    assert not checkpoint(run_dir, 6).exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir), timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {checkpoint(run_dir, 4)} at step 4" in resumed.stderr
    done, expected = checkpoint(run_dir, 8), checkpoint(straight_dir, 8)
    adapter = load_file(done / "adapter_model.safetensors")
    assert any(".layers.0." in k for k in adapter) and any(".layers.1." in k for k in adapter)
    assert_same_tensors(load_file(expected / "adapter_model.safetensors"), adapter, "adapter")
    assert_same_tensors(optimizer_state(expected), optimizer_state(done), "optimizer")

    out = tmp_path / "merged"
    exported = run_forge("export", str(done), str(out), "--merge-lora")
    assert exported.returncode == 0, exported.stderr
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
