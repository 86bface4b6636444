"""Training arguments an optimizer or a schedule given as a partial makes moot are named before
training (Hugging Face's Trainer ignores them without a word), and ``forge code`` writes none
of them into its script."""

from __future__ import annotations

import pytest

from tests.helpers import run_forge

SGD = """\
-- extends 'configs/train.yaml'
-- block optimizer
optimizer: &optimizer !partial:torch.optim:SGD
    lr: 0.1
-- endblock
-- block lr_scheduler
lr_scheduler: &lr_scheduler !partial:torch.optim.lr_scheduler:CosineAnnealingLR
    eta_min: 1.0e-3
-- endblock
"""


@pytest.mark.slow
def test_arguments_a_partial_makes_moot_are_named_and_left_out_of_the_script(tmp_path):
    assert run_forge("new", "demo", "--from", "classifier", "-p", str(tmp_path)).returncode == 0
    project = tmp_path / "demo"
    (project / "templates" / "configs" / "sgd.yaml").write_text(SGD)
    plan = run_forge("train", "sgd", "-p", str(project), "--dry-run", "-D", "max_steps=5")
    assert plan.returncode == 0, plan.stderr
    assert "trainer.args.learning_rate: 0.003 (" in plan.stdout
    assert "changes nothing: the optimizer is torch.optim:SGD (" in plan.stdout
    assert "trainer.args.lr_scheduler_type: 'constant' (" in plan.stdout
    assert "the lr scheduler is torch.optim.lr_scheduler:CosineAnnealingLR" in plan.stdout
    assert "weight_decay" not in plan.stdout  # the library's default: nothing set, nothing said
    plain = run_forge("train", "-p", str(project), "--dry-run", "-D", "max_steps=5")
    assert "changes nothing" not in plain.stdout
    script = run_forge("code", "sgd", "-p", str(project))
    assert script.returncode == 0, script.stderr
    assert "learning_rate=" not in script.stdout and "lr_scheduler_type=" not in script.stdout
    assert "torch.optim.SGD" in script.stdout
