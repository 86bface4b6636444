"""A run a divergence detector stops is recorded as ``diverged`` (detector, step, values) and
``forge train`` ends with its own exit code, 3."""

from __future__ import annotations

import json

from forge.cli.commands import _kept_reasons
from forge.runs import EXIT_DIVERGED
from tests.plain_project import write_project

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


def test_rollbacks_are_recorded_and_after_max_rollbacks_the_run_stops(tmp_path):
    # a limit every loss passes: each check rolls back, until max_rollbacks; rotation to one
    # checkpoint keeps the anchor (step 2) when step 4 is saved
    text = DIVERGING.replace(
        "- !singleton:forge.train:DivergenceDetector\n",
        "- !singleton:forge.train:DivergenceDetector\n        action: rollback\n"
        "        max_rollbacks: 2\n",
    ).replace("max_steps: 8", "max_steps: 8\n    save_steps: 2\n    save_total_limit: 1")
    code, run_dir = train_config(tmp_path, text)
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
    reasons = {path.name: why for path, why in _kept_reasons(run_dir).items()}
    assert reasons == {
        "checkpoint-000002": "rollback anchor",
        "checkpoint-000004": "last, rollback anchor",
    }
