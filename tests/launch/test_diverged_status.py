"""A run a divergence detector stops is recorded as ``diverged`` (detector, step, values) and
``forge train`` ends with its own exit code, 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from forge.read.run import RunReader
from forge.runs import EXIT_DIVERGED
from tests.helpers import run_forge
from tests.plain_project import write_project
from tests.train.common import assert_same_tensors, component_state

DIVERGING = """\
-- extends 'configs/regress.yaml'
-- block callbacks
callbacks: &callbacks !list
    - !singleton:forge.train:DivergenceDetector
        detectors:
            - !singleton:forge.train:LossSpike {factor: null, limit: 0.0, warmup: 1}
-- endblock
-- block trainer_args
    == super()
    max_steps: 8
-- endblock
"""


def train_config(tmp_path, text, overrides=()):
    """Train ``text`` (a config of the plain project) as ``forge train`` does in one process;
    (exit code, run directory)."""
    from forge.config import load_config, load_project
    from forge.launch.worker import run_worker
    from forge.runs import config_output_dir, create_run

    root = write_project(tmp_path / "project")
    (root / "templates" / "configs" / "diverging.yaml").write_text(text)
    project = load_project(root)
    cfg = load_config(project, "diverging", variables={}, overrides=list(overrides))
    run_dir = create_run(
        config_output_dir(project.output_dir, "diverging"),
        config_name="diverging",
        config_text=cfg.text,
        project_root=project.root,
        overrides=list(overrides),
        variables={},
        nproc=1,
    )
    return run_worker(run_dir, project), run_dir


def test_a_diverged_run_is_recorded_and_exits_3(tmp_path):
    code, run_dir = train_config(tmp_path, DIVERGING)
    assert code == EXIT_DIVERGED == 3
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "diverged" and record["step"] == 4  # of 8
    found = record["diverged"]
    # logging_steps 2, warm-up of one log: the second log (step 4) is the first checked
    assert (found["detector"], found["step"], found["metric"]) == ("LossSpike", 4, "loss")
    assert "above the limit 0" in found["message"]
    assert (run_dir / "checkpoints" / "checkpoint-000004").is_dir()


# a limit every loss passes: each check rolls back, until max_rollbacks; rotation to one
# checkpoint keeps the anchor (step 2) when step 4 is saved
ROLLING = DIVERGING.replace(
    "- !singleton:forge.train:DivergenceDetector\n",
    "- !singleton:forge.train:DivergenceDetector\n        action: rollback\n"
    "        max_rollbacks: 2\n",
).replace("max_steps: 8", "max_steps: 8\n    save_steps: 2\n    save_total_limit: 1")


def test_rollbacks_are_recorded_and_after_max_rollbacks_the_run_stops(tmp_path):
    code, run_dir = train_config(tmp_path, ROLLING)
    assert code == EXIT_DIVERGED
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "diverged"
    assert "max_rollbacks (2) reached" in record["diverged"]["message"]
    rollbacks = record["rollbacks"]
    assert [(r["from_step"], r["to_checkpoint"]) for r in rollbacks] == [
        (4, "checkpoint-000002"),
        (4, "checkpoint-000002"),
    ]
    assert all(r["skipped"]["batches"] >= 1 for r in rollbacks)
    # forge checkpoints' KEPT column says why rotation keeps both
    assert record["rollback_anchor_before"] == 1
    reasons = {e.path.name: e.kept for e in RunReader(run_dir).checkpoints() if e.kept}
    assert reasons == {
        "checkpoint-000002": "rollback anchor",
        "checkpoint-000004": "last, rollback anchor",
    }


@pytest.mark.slow
def test_two_processes_roll_back_alike_run_after_run_and_a_diverged_run_exits_3(tmp_path):
    """Through the CLI on two processes (torchrun, gloo): the ranks roll back together (a
    disagreement would hang: run_forge's timeout fails the test, naming the command), two runs
    of the config make the same rollbacks to the same weights, and the run ends diverged, 3."""
    root = write_project(tmp_path / "project")
    (root / "templates" / "configs" / "rolling.yaml").write_text(ROLLING)
    runs = []
    for _ in range(2):
        result = run_forge("train", "rolling", "-p", str(root), "--nproc", "2", timeout=600)
        assert result.returncode == EXIT_DIVERGED, result.stderr
        assert "rolled back from step 4 to checkpoint-000002" in result.stderr
        runs.append(Path(result.stdout.splitlines()[0]))
    records = [json.loads((run / "run.json").read_text()) for run in runs]
    for record in records:
        assert record["status"] == "diverged" and record["world_size"] == 2
        assert "max_rollbacks (2) reached" in record["diverged"]["message"]
        assert [(r["from_step"], r["to_step"]) for r in record["rollbacks"]] == [(4, 2), (4, 2)]
    assert records[0]["rollbacks"] == records[1]["rollbacks"]
    assert records[0]["diverged"] == records[1]["diverged"]
    final = [run / "checkpoints" / "checkpoint-000004" for run in runs]
    assert_same_tensors(*(load_file(ckpt / "model.safetensors") for ckpt in final))
    assert_same_tensors(*(component_state(ckpt, "optimizer") for ckpt in final))


POISONED_PY = '''
import time

import torch
from torch.utils.data import Dataset

from forge.train import TrainerCallback


class Poisoned(Dataset):
    """(x [4], y [1]) tuples, y the sum of x; item ``poisoned``'s target 1e4 times too large."""

    def __init__(self, n: int = 400, poisoned: int = 36) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.y = self.x.sum(dim=1, keepdim=True)
        self.y[poisoned] *= 1e4

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class Pace(TrainerCallback):
    """A step takes at least ``seconds``: time to kill the run between two of its saves."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
'''

# 4 items a step, in order: the poisoned item 36 is in step 10's batch; the rollback restores
# checkpoint 8 and drops steps 9-11's batches; checkpoint 12 is the first saved after it
SPIKING = """\
-- extends 'configs/regress.yaml'
-- block datasets
train_dataset: &train_dataset !singleton:./poisoned.py:Poisoned {}
eval_dataset: &eval_dataset !singleton:./torch_data.py:Points {n: 8}
-- endblock
-- block callbacks
callbacks: &callbacks !list
    - !singleton:forge.train:DivergenceDetector
        action: rollback
        skip_past: 1
        detectors:
            - !singleton:forge.train:LossSpike {warmup: 3}
    - !singleton:./poisoned.py:Pace {}
-- endblock
-- block trainer_args
    == super()
    max_steps: 40
    save_steps: 2
    logging_steps: 1
    per_device_train_batch_size: 4
    train_sampling_strategy: sequential
-- endblock
"""


@pytest.mark.slow
def test_a_run_killed_after_its_rollback_resumes_to_the_same_weights(tmp_path):
    import signal

    from tests.integration.test_train_resume import final_state, start_held

    root = write_project(tmp_path / "project")
    (root / "poisoned.py").write_text(POISONED_PY)
    (root / "templates" / "configs" / "spiking.yaml").write_text(SPIKING)
    straight = run_forge("train", "spiking", "-p", str(root), timeout=600)
    assert straight.returncode == 0, straight.stderr
    straight_dir = Path(straight.stdout.splitlines()[0])
    record = json.loads((straight_dir / "run.json").read_text())
    (entry,) = record["rollbacks"]
    assert (entry["from_step"], entry["to_step"], entry["skipped"]["batches"]) == (10, 8, 3)

    killed, run_dir = start_held("train", "spiking", "-p", str(root), cwd=root, saved=12)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert not (run_dir / "checkpoints" / "checkpoint-000040").exists()
    resumed = run_forge("resume", "-p", str(root), "--run-dir", str(run_dir), timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "rolled back" not in resumed.stderr  # the checkpoint held the rollback already
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["rollbacks"] == [entry]
    for ours, theirs in zip(final_state(run_dir), final_state(straight_dir), strict=True):
        assert_same_tensors(ours, theirs)
