"""What resume must restore or refuse, through the public API (Trainer.train, trainer.scaler).

Each test here fails if the guarded behaviour is removed: a corrupted newest checkpoint
taken for a good one, or the fp16 grad scaler restarting from its default scale.
"""

from __future__ import annotations

import torch

from forge.checkpoint import read_manifest, validate_checkpoint
from forge.train import Trainer, TrainerCallback
from tests.train.common import checkpoint_dir, make_args, make_trainer


class RecordStart(TrainerCallback):
    """Remembers the step training starts at, and the trainer's scaler state then."""

    def __init__(self, trainer: Trainer | None = None) -> None:
        self.trainer = trainer
        self.steps: list[int] = []
        self.scaler_states: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        if self.trainer is not None and self.trainer.scaler is not None:
            self.scaler_states.append(self.trainer.scaler.state_dict())


def test_resume_true_skips_a_corrupted_newest_checkpoint(tmp_path, caplog):
    out = tmp_path / "run"
    args = dict(max_steps=20, save_strategy="steps", save_steps=10)
    make_trainer(make_args(out, **args)).train()
    newest = checkpoint_dir(out, 20)
    # flip the last bytes of a weight file: same size, so only its sha256 tells
    weights = sorted(n for n in read_manifest(newest).files if n.endswith(".safetensors"))
    target = newest / weights[0]
    data = bytearray(target.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
    target.write_bytes(data)

    start = RecordStart()
    resumed = make_trainer(make_args(out, resume_from_checkpoint=True, **args), callbacks=[start])
    resumed.train()  # resume_from_checkpoint comes from the arguments

    assert start.steps == [10]
    assert resumed.state.resumed_from == str(checkpoint_dir(out, 10))
    assert f"skipping {newest.name}: {weights[0]}: xxh3_128 mismatch" in caplog.text
    assert resumed.state.global_step == 20
    assert validate_checkpoint(newest) == []  # saved again, whole


class OverflowAtFirst(Trainer):
    """The first 3 steps' losses are scaled so far that fp16 gradients overflow: the grad
    scaler skips those steps and halves its scale each time, as on a real loss spike."""

    def compute_loss(self, model, batch):
        loss = super().compute_loss(model, batch)
        return loss * 1e8 if self.state.global_step < 3 else loss


def test_fp16_grad_scaler_state_is_restored_on_resume(tmp_path):
    out = tmp_path / "run"
    first = make_trainer(
        make_args(out, max_steps=4, fp16=True, save_strategy="steps", save_steps=4),
        trainer_cls=OverflowAtFirst,
    )
    first.train()
    saved = first.scaler.state_dict()
    default_scale = torch.amp.GradScaler("cpu").get_scale()
    assert saved["scale"] == default_scale / 8  # three overflows, three halvings
    assert read_manifest(checkpoint_dir(out, 4)).step == 4

    resumed = make_trainer(make_args(out, max_steps=6, fp16=True, save_strategy="no"))
    start = RecordStart(resumed)
    resumed.add_callback(start)
    resumed.train(resume_from_checkpoint=True)

    assert start.steps == [4]
    assert start.scaler_states == [saved]  # scale and growth tracker, not a fresh scaler
    assert start.scaler_states[0]["scale"] != default_scale
