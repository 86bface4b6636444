"""`forge train` on every rank of a job another launcher started (here a user's torchrun).

The slow test in test_accel.py starts the same path through `accelerate launch`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import REPO
from tests.integration.conftest import SMALL
from tests.train.common import assert_same_tensors

pytestmark = pytest.mark.integration

# Loaded by every rank (not by torchrun's agent, which has no RANK): notes each start of a
# process group, and has rank 0 come late to every group after its first, as a busy machine
# may. A second default group on the launcher's store then meets the first one's keys: rank 1
# reads rank 0's old address before rank 0 has written the new one, and gloo's connectFullMesh
# fails with "Connection refused".
SITECUSTOMIZE = """
import os
if os.environ.get("RANK") is not None:
    import time
    import torch.distributed as dist

    _init = dist.init_process_group
    _starts = []

    def init_process_group(*args, **kwargs):
        _starts.append(time.time())
        with open(os.environ["GROUP_STARTS"], "a") as out:
            out.write(f"{os.environ['RANK']} {os.getpid()}\\n")
        if os.environ["RANK"] == "0" and len(_starts) > 1:
            time.sleep(3)
        return _init(*args, **kwargs)

    dist.init_process_group = init_process_group
"""


def torchrun_forge(*args: str, site: Path, starts: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 -m forge.cli ARGS``, as a user starts it, with the
    sitecustomize above noting each group's start in ``starts``."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
        GROUP_STARTS=str(starts),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node=2", "-m", "forge.cli", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def group_starts(starts: Path) -> list[str]:
    """The ranks that started a process group, one entry per start, sorted."""
    return sorted(line.split()[0] for line in starts.read_text().splitlines())


@pytest.fixture(scope="module")
def launched(warm_project, tmp_path_factory):
    """tiny_lm trained 4 steps (checkpoints at 2 and 4) by a user's torchrun of forge train."""
    root = tmp_path_factory.mktemp("launched")
    project = root / "tiny_lm"
    shutil.copytree(warm_project, project)
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    starts = root / "group_starts.txt"
    result = torchrun_forge(
        "train", "-p", str(project), *SMALL, "-D", "max_steps=4", "-D", "save_steps=2",
        site=site, starts=starts,
    )  # fmt: skip
    return project, site, starts, result


def test_a_launched_job_starts_one_process_group_per_rank(launched):
    """The checks before training run the trainer's paths, which need the group: they share the
    job's one group with training instead of starting and ending one of their own."""
    project, _, starts, result = launched
    assert result.returncode == 0, result.stderr[-3000:]
    assert group_starts(starts) == ["0", "1"]  # one start on each rank
    runs = sorted((project / "output" / "train").iterdir())
    assert [r.name for r in runs] == ["run_001"]
    record = json.loads((runs[0] / "run.json").read_text())
    assert record["status"] == "completed"
    manifest = json.loads(
        (runs[0] / "checkpoints" / "checkpoint-000004" / "manifest.json").read_text()
    )
    assert manifest["topology"]["world_size"] == 2


def test_a_launched_resume_continues_the_run_exactly(launched, tmp_path):
    """`torchrun ... -m forge.cli resume` (the way back for a job its user launched): rank 0
    claims and plans the resume, both ranks train from the checkpoint, in one group per rank,
    and step 4 comes out bit for bit as the straight run wrote it."""
    source, site, _, trained = launched
    assert trained.returncode == 0, trained.stderr[-3000:]
    project = tmp_path / "tiny_lm"
    shutil.copytree(source, project)
    run_dir = project / "output" / "train" / "run_001"
    checkpoints = run_dir / "checkpoints"
    straight = load_file(checkpoints / "checkpoint-000004" / "model.safetensors")
    starts = tmp_path / "group_starts.txt"
    result = torchrun_forge(
        "resume", "-p", str(project), "--run-dir", str(run_dir),
        "--from", str(checkpoints / "checkpoint-000002"), site=site, starts=starts,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert group_starts(starts) == ["0", "1"]
    assert result.stderr.count("resumed from") == 1, result.stderr[-3000:]  # rank 0 says it
    assert "damaged" not in result.stderr  # a checkpoint --from names: the final one is sound
    assert result.stdout.strip() == str(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["step"] == 4
    assert [(r["from"], r["world_size"]) for r in record["resumes"]] == [
        (str(checkpoints / "checkpoint-000002"), 2)
    ]
    resumed = load_file(checkpoints / "checkpoint-000004" / "model.safetensors")
    assert_same_tensors(straight, resumed, "model")


def test_a_launched_resume_refuses_what_belongs_to_the_launcher(launched, tmp_path):
    """`--requeue` under a user's launcher would be accepted and do nothing (forge requeues
    only a job it launched): refused before any training, the run left as it was."""
    project, site, _, trained = launched
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = project / "output" / "train" / "run_001"
    before = (run_dir / "run.json").read_text()
    result = torchrun_forge(
        "resume", "-p", str(project), "--requeue", site=site, starts=tmp_path / "starts.txt"
    )
    assert result.returncode != 0
    assert "another launcher (accelerate launch, torchrun); drop --requeue" in result.stderr
    assert "resumed from" not in result.stderr
    assert (run_dir / "run.json").read_text() == before


def test_a_launched_evaluate_prints_its_metrics_once(launched, tmp_path):
    """`torchrun ... -m forge.cli evaluate RUN --json`: the ranks evaluate their shares of the
    split, and rank 0 alone prints the one JSON object, with the loss the run's own final
    evaluation on those 2 processes logged (max_eval_batches limits each process's share,
    so one process would read other items)."""
    project, site, _, trained = launched
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = project / "output" / "train" / "run_001"
    result = torchrun_forge("evaluate", str(run_dir), "--json", site=site, starts=tmp_path / "s")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [
        entry["eval_loss"] for entry in logged if entry.get("step") == 4 and "eval_loss" in entry
    ]
    assert len(final) == 1, logged
    assert json.loads(lines[0])["eval_loss"] == pytest.approx(final[0], rel=1e-6)


def test_a_launched_dry_run_prints_its_plan_once(launched, tmp_path):
    """`torchrun ... -m forge.cli train --dry-run`: every rank checks, rank 0 alone prints the
    plan (stdout is data: a script reading it gets one plan), and no run is created."""
    project, site, _, trained = launched
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = torchrun_forge(
        "train", "-p", str(project), *SMALL, "--dry-run", site=site, starts=tmp_path / "s"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("renders and checks; would train with 2 process(es)") == 1
    assert result.stdout.count("\nplan:") == 1, result.stdout
    assert [r.name for r in (project / "output" / "train").iterdir()] == ["run_001"]
