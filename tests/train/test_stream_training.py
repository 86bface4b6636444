"""Training on a stream (an IterableDataset): it trains to max_steps across the stream's
epochs, a stopped run resumes bit-identical (shuffle buffer on), and the mistakes a stream
brings are refused with the key to change."""

from __future__ import annotations

import signal

import pytest
from torch.utils.data import IterableDataset

from forge.data.streams import StreamError
from forge.train import TrainingInterrupted
from forge.train.args import TrainingArgumentsError
from tests.train.common import (
    SignalAtStep,
    TokenDataset,
    assert_same_training,
    make_args,
    make_trainer,
)


class TokenStream(IterableDataset):
    """``TokenDataset``'s items as a stream without length, shards or state of its own."""

    def __init__(self, n: int) -> None:
        self.data = TokenDataset(n)

    def __iter__(self):
        for index in range(len(self.data)):
            yield self.data[index]


def stream_args(output_dir, **overrides):
    values = dict(
        max_steps=16,  # 30 items / batch 4: the stream's epochs end mid-batch, several times
        save_strategy="steps",
        save_steps=4,
        stream_shuffle_buffer=6,
        lr_scheduler_type="linear",
    )
    values.update(overrides)
    return make_args(output_dir, **values)


def stream_trainer(args, items: int = 30, **kwargs):
    trainer = make_trainer(args, train_size=1, **kwargs)
    trainer.train_dataset = TokenStream(items)
    return trainer


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stopped_stream_run_resumes_bit_identical(tmp_path, workers):
    straight = stream_trainer(stream_args(tmp_path / "straight", dataloader_num_workers=workers))
    straight.train()
    assert straight.state.epoch >= 1 or workers  # the stream was read more than once
    out = tmp_path / "run"
    first = stream_trainer(
        stream_args(out, dataloader_num_workers=workers), callbacks=[SignalAtStep(6)]
    )
    with pytest.raises(TrainingInterrupted):
        first.train()
    resumed = stream_trainer(stream_args(out, dataloader_num_workers=workers))
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == 16
    assert_same_training(straight, resumed)


def test_a_stream_needs_max_steps(tmp_path):
    trainer = stream_trainer(stream_args(tmp_path, max_steps=-1, num_train_epochs=2))
    with pytest.raises(TrainingArgumentsError, match=r"max_steps must be set .*TokenStream"):
        trainer.train()


@pytest.mark.slow  # loader worker processes
def test_a_stream_resumed_with_other_loader_workers_deals_its_position(tmp_path, caplog):
    """Saved by one reader, continued by 2 loader workers: the rest of the saved shard and
    the shuffle buffer are dealt to them, and training goes on to max_steps."""
    first = stream_trainer(stream_args(tmp_path), callbacks=[SignalAtStep(6)])
    with pytest.raises(TrainingInterrupted):
        first.train()
    again = stream_trainer(stream_args(tmp_path, dataloader_num_workers=2))
    assert again.train(resume_from_checkpoint=True).global_step == 16
    assert "1 shard(s) not finished by the 1 saved reader(s)" in caplog.text
    assert "dealt to 2 reader(s)" in caplog.text


def test_ignore_data_skip_starts_the_stream_again(tmp_path, caplog):
    first = stream_trainer(stream_args(tmp_path), callbacks=[SignalAtStep(6)])
    with pytest.raises(TrainingInterrupted):
        first.train()
    again = stream_trainer(stream_args(tmp_path, ignore_data_skip=True))
    assert again.train(resume_from_checkpoint=True).global_step == 16
    assert "starts again from its first item" in caplog.text


def test_an_empty_stream_fails_with_a_message(tmp_path):
    trainer = stream_trainer(stream_args(tmp_path), items=0)
    with pytest.raises(StreamError, match="holds no item"):
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) is not None


def test_an_eval_stream_is_read_once_in_order_and_bounded_by_max_eval_batches(tmp_path):
    """An evaluation stream gives the metrics of the same items as a map-style dataset; with
    max_eval_batches, of its first batches only."""
    trainer = stream_trainer(stream_args(tmp_path, per_device_eval_batch_size=4))
    whole = trainer.evaluate(TokenStream(10))["eval_loss"]
    assert whole == trainer.evaluate(TokenDataset(10))["eval_loss"]
    trainer.args.max_eval_batches = 1
    first = trainer.evaluate(TokenStream(10))["eval_loss"]
    trainer.args.max_eval_batches = None
    assert first == trainer.evaluate(TokenDataset(4))["eval_loss"] != whole
