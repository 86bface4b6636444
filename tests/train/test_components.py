"""Checkpoint components that callbacks register, the hook after each optimizer step, and
per-rank state that follows the data-parallel replica across trainers.

The torchrun tests run the pipeline trainer with 2 stages on 2 real processes (gloo);
tests/train/components_script.py is what each process runs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from forge.checkpoint import Component, Scope, read_manifest
from forge.train import Trainer, TrainerCallback
from tests.train.common import (
    StopAtStep,
    checkpoint_dir,
    component_state,
    make_args,
    make_trainer,
    run_torchrun,
)
from tests.train.components_script import ShadowCallback, ShadowWeights, run

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("components_script.py")


def torchrun(output_dir: Path, kind: str, **extra) -> None:
    """components_script.py on 2 processes (a pipeline of 2 stages)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    run_torchrun(SCRIPT, str(output_dir), kind, json.dumps(extra))


def shadow(output_dir: Path, rank: int, tag: str) -> tuple[int, dict[str, torch.Tensor]]:
    """The step and the shadow weights a rank wrote when training began or ended."""
    state = torch.load(output_dir / f"shadow-rank-{rank}-{tag}.pt", weights_only=True)
    return state.pop("step"), state


def step_losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "train_runtime" not in r}


def found(state, key: str) -> list:
    """Every value of ``key`` in a nested state."""
    if isinstance(state, dict):
        return [v for k, v in state.items() if k == key] + [
            x for v in state.values() for x in found(v, key)
        ]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in found(v, key)]
    return []


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------------- on_optimizer_step


class InfLossAtStep(Trainer):
    """Makes the loss infinite during the step that will become ``bad_step``."""

    bad_step = 3

    def compute_loss(self, model, batch):
        loss = super().compute_loss(model, batch)
        return loss * float("inf") if self.state.global_step + 1 == self.bad_step else loss


class AppliedSteps(TrainerCallback):
    """What ``on_optimizer_step`` said, by the step it belongs to, and the shadow weights a
    component registered through the callback keeps."""

    def __init__(self) -> None:
        self.applied: dict[int, bool] = {}
        self.weights: ShadowWeights | None = None

    def on_register(self, args, state, control, register, model=None, **kwargs):
        self.weights = ShadowWeights(model)
        register(Component("shadow", self.weights, Scope.STAGE))

    def on_optimizer_step(self, args, state, control, applied, **kwargs):
        self.applied[state.global_step + 1] = applied


@pytest.mark.parametrize(
    ("optimizer", "skip_nonfinite"),
    [(None, True), (functools.partial(torch.optim.SGD, lr=0.1), True), (None, False)],
    ids=["decided-on-the-device", "decided-on-the-host", "skipping-off"],
)
def test_the_step_hook_knows_whether_the_step_was_applied(tmp_path, optimizer, skip_nonfinite):
    seen = AppliedSteps()
    args = make_args(tmp_path, max_steps=6, skip_nonfinite=skip_nonfinite, max_grad_norm=None)
    trainer = make_trainer(args, trainer_cls=InfLossAtStep, callbacks=[seen], optimizer=optimizer)
    trainer.train()
    expected = {step: step != 3 or not skip_nonfinite for step in range(1, 7)}
    assert seen.applied == expected
    assert all(type(applied) is bool for applied in seen.applied.values())
    # the component registered by the callback heard the same: it moved on applied steps only
    assert seen.weights.updates == sum(expected.values())
    assert trainer.state.nonfinite_skipped == (1 if skip_nonfinite else 0)


class OverflowAtFirst(Trainer):
    """The first 3 steps' fp16 gradients overflow (finite losses): the grad scaler skips them."""

    def compute_loss(self, model, batch):
        loss = super().compute_loss(model, batch)
        return loss * 1e8 if self.state.global_step < 3 else loss


def test_the_step_hook_sees_the_steps_a_grad_scaler_skipped(tmp_path):
    seen = AppliedSteps()
    args = make_args(tmp_path, max_steps=4, fp16=True)
    make_trainer(args, trainer_cls=OverflowAtFirst, callbacks=[seen]).train()
    assert seen.applied == {1: False, 2: False, 3: False, 4: True}
    assert seen.weights.updates == 1


# ------------------------------------------------------------------------- callbacks' components


def test_a_callback_registers_components_of_any_scope_and_they_resume_exactly(tmp_path):
    """Plain trainer, one process: a callback's stage-scoped component, stopped at step 3 and
    resumed to 6, is restored exactly and ends where a straight run's ends, bit for bit; a
    rank-scoped one round-trips the same way."""
    run(tmp_path / "straight", "plain")
    run(tmp_path / "run", "plain", stop_at=3)
    ckpt = checkpoint_dir(tmp_path / "run", 3)
    resumed = run(tmp_path / "run", "plain", resume=str(ckpt))
    assert shadow(tmp_path / "run", 0, "begin")[0] == 3
    assert_equal_states(shadow(tmp_path / "run", 0, "begin")[1], component_state(ckpt, "shadow"))
    assert resumed.callback_handler.callbacks[-1].weights.updates == 3  # steps 4-6
    end, straight = shadow(tmp_path / "run", 0, "end"), shadow(tmp_path / "straight", 0, "end")
    assert end[0] == straight[0] == 6
    assert_equal_states(end[1], straight[1])
    manifest = read_manifest(ckpt)
    assert manifest.components["shadow"] == {
        "scope": "stage", "weights": False, "files": ["shadow.pt"],
    }  # fmt: skip
    assert component_state(ckpt, "callbacks") == {}  # not also saved as shared state

    # rank scope, registered the same way
    args = make_args(tmp_path / "ranked", max_steps=4, save_strategy="steps", save_steps=2)
    make_trainer(args, callbacks=[ShadowCallback(scope=Scope.RANK)]).train()
    ckpt = checkpoint_dir(tmp_path / "ranked", 2)
    assert read_manifest(ckpt).components["shadow"]["files"] == ["shadow-rank-00000.pt"]
    again = ShadowCallback(scope=Scope.RANK)
    args = make_args(tmp_path / "ranked", max_steps=4, resume_from_checkpoint=str(ckpt))
    make_trainer(args, callbacks=[again]).train()
    assert_equal_states(again.at_begin, component_state(ckpt, "shadow", rank=0))


def test_a_callbacks_stage_component_resumes_under_the_pipeline_trainer_in_one_process(tmp_path):
    run(tmp_path / "straight", "pipeline")
    run(tmp_path / "run", "pipeline", stop_at=3)
    at_stop = shadow(tmp_path / "run", 0, "end")
    assert at_stop[0] == 3
    run(tmp_path / "run", "pipeline", resume=str(checkpoint_dir(tmp_path / "run", 3)))
    assert_equal_states(shadow(tmp_path / "run", 0, "begin")[1], at_stop[1])
    end, straight = shadow(tmp_path / "run", 0, "end"), shadow(tmp_path / "straight", 0, "end")
    assert end[0] == straight[0] == 6
    assert_equal_states(end[1], straight[1])


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


class TransformRegisters(Trainer):
    """A model transform (the adapter step) that owns checkpoint state of its own."""

    def apply_adapters(self, model):
        self.counter = Counter()
        self.register(Component("adapter_steps", self.counter, Scope.STAGE))
        return model

    def optimizer_step(self):
        self.counter.count += 1
        super().optimizer_step()


def test_a_model_transform_registers_through_the_same_api(tmp_path):
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    make_trainer(args, trainer_cls=TransformRegisters, callbacks=[StopAtStep(2)]).train()
    ckpt = checkpoint_dir(tmp_path, 2)
    names = list(read_manifest(ckpt).components)
    assert names.index("model") < names.index("adapter_steps") < names.index("data")
    assert component_state(ckpt, "adapter_steps") == {"count": 2}
    args = make_args(tmp_path, max_steps=4, resume_from_checkpoint=str(ckpt))
    resumed = make_trainer(args, trainer_cls=TransformRegisters)
    resumed.train()
    assert resumed.counter.count == 4  # 2 restored + 2 more


@pytest.mark.integration
@pytest.mark.slow
def test_a_callbacks_stage_component_resumes_exactly_under_two_pipeline_stages(tmp_path):
    """2 stages on 2 processes: each stage's shadow weights are its own, written to its own
    file, and restored exactly into that stage; the resumed run ends as the straight one."""
    torchrun(tmp_path / "straight", "pipeline")
    torchrun(tmp_path / "run", "pipeline", stop_at=3)
    ckpt = checkpoint_dir(tmp_path / "run", 3)
    assert read_manifest(ckpt).components["shadow"]["files"] == [
        "shadow-stage-00000-of-00002.pt",
        "shadow-stage-00001-of-00002.pt",
    ]
    at_stop = [shadow(tmp_path / "run", rank, "end") for rank in range(2)]
    assert [step for step, _ in at_stop] == [3, 3]
    first, last = at_stop[0][1], at_stop[1][1]
    assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
    # each stage keeps its own parameters; the last holds the tied embedding as its head
    assert first.keys() & last.keys() == {"model.embed_tokens.weight"}
    torchrun(tmp_path / "run", "pipeline", resume=str(ckpt))
    for rank in range(2):
        begin = shadow(tmp_path / "run", rank, "begin")
        assert begin[0] == 3
        assert_equal_states(begin[1], at_stop[rank][1])  # restored exactly, into its own stage
        end, straight = (
            shadow(tmp_path / "run", rank, "end"),
            shadow(tmp_path / "straight", rank, "end"),
        )
        assert end[0] == straight[0] == 6
        assert_equal_states(end[1], straight[1])


# ------------------------------------------------------------------------- data position


@pytest.mark.integration
def test_a_pipeline_checkpoint_continued_by_the_plain_trainer_keeps_its_data_position(tmp_path):
    """2 stages x 1 replica -> the plain trainer on 1 process (1 replica): the position maps,
    so the continued run trains on the batches the straight run trains on, not the epoch's
    first ones again."""
    torchrun(tmp_path / "pipeline", "pipeline", stop_at=3)
    ckpt = checkpoint_dir(tmp_path / "pipeline", 3)
    assert read_manifest(ckpt).topology == {"world_size": 2, "num_stages": 2, "dp_size": 1}
    continued = run(tmp_path / "plain", "plain", resume=str(ckpt), save_final_checkpoint=True)
    straight = run(tmp_path / "straight", "plain")
    # 8 sequences a step: 6 steps took 48 of the epoch's 64 (a restarted epoch: 24)
    final = checkpoint_dir(tmp_path / "plain", 6)
    assert found(component_state(final, "data", rank=0), "yielded") == [48]
    assert continued.state.epoch == straight.state.epoch == 0.75
    losses, expected = step_losses(tmp_path / "plain"), step_losses(tmp_path / "straight")
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert losses[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


def test_the_docs_callback_with_state_per_stage_counts_skipped_steps_and_resumes(tmp_path):
    """docs/checkpoints.md's example callback, run as a user would: it counts the skipped
    step, writes its own file, and a resumed run restores the count."""
    from tests.docs import block

    namespace: dict = {}
    exec(block("python", "# a callback with state per pipeline stage"), namespace)
    counter = namespace["SkippedSteps"]()
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    make_trainer(args, trainer_cls=InfLossAtStep, callbacks=[counter]).train()
    assert counter.skipped == 1
    ckpt = checkpoint_dir(tmp_path, 4)
    assert "skipped_steps" in read_manifest(ckpt).components
    resumed = namespace["SkippedSteps"]()
    args = make_args(tmp_path, max_steps=6, save_strategy="no", resume_from_checkpoint=str(ckpt))
    make_trainer(args, trainer_cls=InfLossAtStep, callbacks=[resumed]).train()
    assert resumed.skipped == 1  # restored from the checkpoint; steps 5 and 6 were applied
