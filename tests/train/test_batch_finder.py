"""auto_find_batch_size: an out-of-memory error halves the micro-batch, the step stays the same.

The out-of-memory error comes from the model itself (no forge hook): its forward raises
``torch.OutOfMemoryError`` when a batch has more rows than it "fits", after drawing its dropout
mask, so a redone step must also put the random generators back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from forge.train import Trainer, TrainerCallback, TrainingArgumentsError
from forge.train.args.pipeline import PipelineTrainingArguments
from forge.train.batch_finder import auto_batch_problems, found_batch_record, split_batch
from forge.train.callbacks import TrainerState
from forge.train.topology import Topology
from tests.train.common import checkpoint_dir, component_state, make_args


class Points(Dataset):
    """``n`` items ``{"x": 6 features, "labels": a class of 3}`` from a seeded generator."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=generator)
        self.y = torch.randint(3, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


class Fits(nn.Module):
    """A classifier whose forward runs out of memory above ``fits`` rows (counted in
    ``out_of_memory``); ``largest`` is the most rows a forward that fitted had."""

    def __init__(self, fits: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3))
        self.fits, self.out_of_memory, self.largest = fits, 0, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)  # draws the dropout mask first
        if x.shape[0] > self.fits:
            self.out_of_memory += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        self.largest = max(self.largest, x.shape[0])
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "train_runtime" not in logs:
            self.losses.append(logs["loss"])


def train(tmp_path, model, *, batch, accumulation, auto, resume=None, **overrides):
    values = dict(
        max_steps=12,  # 64 items / 8 per step = 8 steps per epoch: crosses an epoch
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        auto_find_batch_size=auto,
        logging_steps=1,
        save_strategy="steps",
        save_steps=6,
        dataloader_drop_last=True,
    )
    values.update(overrides)
    losses = Losses()
    trainer = Trainer(model, make_args(tmp_path, **values), Points(), callbacks=[losses])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses.losses


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """Batch 8 with auto_find_batch_size on a model that fits 2 rows."""
    model = Fits(fits=2)
    trainer, losses = train(
        tmp_path_factory.mktemp("auto"), model, batch=8, accumulation=1, auto=True
    )
    return trainer, losses, model


def test_the_found_batch_trains_as_the_smaller_batch_with_accumulation(auto_run, tmp_path):
    trainer, losses, model = auto_run
    assert model.out_of_memory == 2  # 8 rows, then 4, then 2 fit: never tried again
    assert model.largest == 2
    assert trainer.state.train_batch_size == 2
    reference, expected = train(tmp_path, Fits(fits=2), batch=2, accumulation=4, auto=False)
    assert len(losses) == len(expected) == 12
    assert losses == pytest.approx(expected, rel=1e-6)
    for name, tensor in reference.model.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_keeps_the_size_and_a_resume_starts_from_it(auto_run, tmp_path):
    trainer, _, _ = auto_run
    saved = component_state(checkpoint_dir(trainer.args.output_dir, 6), "trainer")
    assert saved["trainer_state"]["train_batch_size"] == 2
    record = found_batch_record(trainer.args, trainer.state)
    assert record == {
        "train_batch_size": {
            "per_device": 2,
            "gradient_accumulation_steps": 4,
            "configured": {"per_device": 8, "gradient_accumulation_steps": 1},
        }
    }

    model = Fits(fits=2)
    resumed, _ = train(
        tmp_path,
        model,
        batch=8,
        accumulation=1,
        auto=True,
        resume=str(checkpoint_dir(trainer.args.output_dir, 6)),
    )
    assert model.out_of_memory == 0  # the resumed run starts at the size that fitted
    assert resumed.state.train_batch_size == 2
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name


def test_uneven_pieces_count_by_their_rows(tmp_path):
    """5 rows on a model that fits 3: pieces of 3 and 2, each piece's mean loss weighted by its
    share of the rows, so the step is the loaded batch's (without dropout, whose masks differ
    between one draw of 5 rows and two of 3 and 2)."""
    auto, auto_losses = train(
        tmp_path / "a", Fits(3, dropout=0.0), batch=5, accumulation=2, auto=True, max_steps=4
    )
    assert auto.state.train_batch_size == 3
    plain, plain_losses = train(
        tmp_path / "b", Fits(5, dropout=0.0), batch=5, accumulation=2, auto=False, max_steps=4
    )
    assert auto_losses == pytest.approx(plain_losses, rel=1e-6)
    for name, tensor in plain.model.state_dict().items():
        torch.testing.assert_close(auto.model.state_dict()[name], tensor, rtol=1e-6, atol=1e-7)


def test_no_smaller_than_one_row(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="micro-batches of 1 row"):
        train(tmp_path, Fits(fits=0), batch=4, accumulation=1, auto=True, max_steps=2)


def test_off_it_is_the_error_it_was(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train(tmp_path, Fits(fits=2), batch=4, accumulation=1, auto=False, max_steps=2)


class CpuAllocatorFails(Fits):
    def forward(self, x, labels):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8")


def test_a_cpu_allocation_failure_is_not_retried(tmp_path):
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        train(tmp_path, CpuAllocatorFails(), batch=4, accumulation=1, auto=True, max_steps=2)


def test_split_batch_cuts_rows_and_keeps_the_rest():
    batch = {"x": torch.arange(5), "names": list("abcde"), "flag": True}
    pieces = split_batch(batch, 2)
    assert [p["x"].tolist() for p in pieces] == [[0, 1], [2, 3], [4]]
    assert [p["names"] for p in pieces] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(p["flag"] is True for p in pieces)
    assert split_batch(batch, 5) == [batch]
    with pytest.raises(ValueError, match="'y' has 3 rows where the batch has 5"):
        split_batch({"x": torch.zeros(5, 2), "y": torch.zeros(3)}, 2)


def test_the_argument_is_checked_with_its_key(tmp_path):
    with pytest.raises(TrainingArgumentsError, match=r"trainer\.args\.auto_find_batch_size"):
        make_args(tmp_path, auto_find_batch_size="yes")


def test_several_processes_are_refused_with_the_reason(tmp_path):
    args = make_args(tmp_path, auto_find_batch_size=True)
    assert auto_batch_problems(args, Topology(world_size=1)) == []
    (problem,) = auto_batch_problems(args, Topology(rank=0, world_size=2))
    assert problem.startswith("trainer.args.auto_find_batch_size needs a job of one process")
    assert "cannot agree to shrink" in problem
    assert auto_batch_problems(make_args(tmp_path), Topology(rank=0, world_size=2)) == []


def test_the_pipeline_trainer_refuses_it(tmp_path):
    with pytest.raises(TrainingArgumentsError) as err:
        PipelineTrainingArguments(
            output_dir=str(tmp_path), auto_find_batch_size=True, report_to="none"
        )
    assert "trainer.args.auto_find_batch_size: the pipeline trainer's micro-batches" in str(
        err.value
    )


def test_nothing_is_recorded_when_it_is_off(tmp_path):
    state = TrainerState(train_batch_size=2)
    assert found_batch_record(make_args(tmp_path), state) == {}


def test_run_json_records_the_size_at_each_checkpoint(auto_run, tmp_path):
    from forge.launch.worker import make_run_record_callback
    from forge.runs import RunRecord

    trainer, _, _ = auto_run
    record = RunRecord(tmp_path, {"status": "running"})
    callback = make_run_record_callback(record)
    checkpoint = tmp_path / "checkpoints" / "checkpoint-000006"
    callback.on_save(trainer.args, trainer.state, None, checkpoint_path=str(checkpoint))
    saved = RunRecord.load(tmp_path).data
    assert saved["train_batch_size"]["per_device"] == 2
    assert saved["train_batch_size"]["gradient_accumulation_steps"] == 4


# --------------------------------------------------------------------------- padded text


class Texts(Dataset):
    """48 token sequences of 3 to 16 tokens: a batch is padded to its longest item."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 17, (48,), generator=generator)
        self.items = [torch.randint(3, 128, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[index]}


def fitting_llama(fits: int):
    """A tiny Llama with attention dropout whose forward runs out of memory above ``fits``
    rows, after drawing its dropout masks."""
    from transformers import LlamaForCausalLM

    from tests.train.common import tiny_llama_config

    class Fitting(LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            if input_ids.shape[0] > fits:
                raise torch.OutOfMemoryError(f"CUDA out of memory ({input_ids.shape[0]} rows)")
            return out

    torch.manual_seed(0)
    return Fitting(tiny_llama_config())


def train_text(tmp_path, *, batch, accumulation, auto, workers=0):
    from forge.data import CausalLMCollator

    args = make_args(
        tmp_path,
        max_steps=8,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        auto_find_batch_size=auto,
        logging_steps=1,
        dataloader_num_workers=workers,
    )
    losses = Losses()
    trainer = Trainer(
        fitting_llama(4),
        args,
        Texts(),
        data_collator=CausalLMCollator(pad_token_id=0),
        callbacks=[losses],
    )
    trainer.train()
    return trainer, losses.losses


@pytest.mark.parametrize("workers", [0, 1])
def test_on_padded_text_with_dropout_the_pieces_are_the_smaller_batches_bitwise(tmp_path, workers):
    """8 x 1 found to fit 4 rows trains as 4 x 2 configured: each piece is collated from its
    items (its own padding width, so its dropout masks are those of the smaller batch)."""
    found, losses = train_text(
        tmp_path / "auto", batch=8, accumulation=1, auto=True, workers=workers
    )
    assert found.state.train_batch_size == 4
    reference, expected = train_text(tmp_path / "ref", batch=4, accumulation=2, auto=False)
    assert len(losses) == 8 and losses == expected
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(found.model.state_dict()[name], tensor), name


def test_evaluation_batches_shrink_too(tmp_path):
    """An evaluation that runs out of memory is run again with half the batch: the metrics are
    those of an evaluation configured with the batch that fits."""
    args = make_args(tmp_path, per_device_eval_batch_size=8, auto_find_batch_size=True)
    model = Fits(fits=2)
    found = Trainer(model, args, Points(), eval_dataset=Points(16, seed=1)).evaluate()
    assert model.out_of_memory == 2 and model.largest == 2
    args = make_args(tmp_path, per_device_eval_batch_size=2)
    expected = Trainer(Fits(fits=2), args, Points(), eval_dataset=Points(16, seed=1)).evaluate()
    assert found["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)


def test_the_sanity_pass_runs_out_of_memory_and_shrinks_without_a_crash(tmp_path):
    from forge.train.sanity import run_sanity_pass

    args = make_args(
        tmp_path, per_device_train_batch_size=8, auto_find_batch_size=True, eval_strategy="steps"
    )
    model = Fits(fits=2)
    trainer = Trainer(model, args, Points(), eval_dataset=Points(16, seed=1))
    state = torch.get_rng_state()
    run_sanity_pass(trainer, 2)
    assert model.out_of_memory == 4 and model.largest == 2  # training's 8, 4; evaluation's 8, 4
    assert torch.equal(torch.get_rng_state(), state)


def test_the_accelerate_trainer_finds_the_batch_and_trains_as_the_plain_trainer(auto_run, tmp_path):
    from forge.train import AccelTrainer
    from forge.train.args.accelerate import AccelTrainingArguments

    _, expected, _ = auto_run
    model, losses = Fits(fits=2), Losses()
    values = dict(
        max_steps=12,
        per_device_train_batch_size=8,
        auto_find_batch_size=True,
        logging_steps=1,
        save_strategy="no",
        dataloader_drop_last=True,
    )
    args = AccelTrainingArguments(**make_args(tmp_path, **values).to_dict())
    trainer = AccelTrainer(model, args, Points(), callbacks=[losses])
    trainer.train()
    assert model.out_of_memory == 2 and model.largest == 2
    assert trainer.state.train_batch_size == 2
    assert losses.losses == pytest.approx(expected, rel=1e-6)
