"""Random numbers drawn in DataLoader workers (an augmentation in ``__getitem__``, noise and
timesteps a collator draws per batch, as a diffusion model's does) resume exactly: each batch's
draws follow from the run's seed, the rank, the epoch and the batch's items
(forge.data.loader.WorkerSeededBatches), so training 10 steps straight and 4, a stop and a
resume to 10 give bit-identical weights and optimizer state, with 0 or 2 workers, persistent or
not, on 1 process (here) and 2 (``-m slow``)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from forge.data.loader import build_dataloader
from forge.train import Trainer
from tests.train.common import StopAtStep, assert_same_training, make_args, run_torchrun


class NoisyPoints(Dataset):
    """48 points; each fetch adds a random jitter (an augmentation)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(48, 4, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index] + 0.1 * torch.randn(4)}


class Diffusion:
    """A collator that draws each batch's noise and timesteps, as diffusion training does."""

    def __call__(self, items: list[dict]) -> dict:
        x = torch.stack([item["x"] for item in items])
        t = torch.randint(0, 10, (len(items),))
        noise = torch.randn_like(x)
        return {"noisy": x + noise * (t[:, None] / 10), "noise": noise, "t": t.float()}


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, noisy, noise, t):
        predicted = self.net(torch.cat([noisy, t[:, None]], dim=-1))
        return {"loss": nn.functional.mse_loss(predicted, noise)}


def train(output_dir: Path, workers: int, persistent: bool, stop_at: int | None = None):
    args = make_args(
        output_dir,
        max_steps=10,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=8,
        dataloader_num_workers=workers,
        dataloader_persistent_workers=persistent,
        remove_unused_columns=False,
    )
    callbacks = [StopAtStep(stop_at)] if stop_at else []
    trainer = Trainer(Denoiser, args, NoisyPoints(), data_collator=Diffusion(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=stop_at is None and (output_dir / "checkpoints").is_dir())
    return trainer


@pytest.mark.parametrize(
    ("workers", "persistent"), [(0, False), (2, False), (2, True)], ids=["0", "2", "2-persistent"]
)
def test_draws_in_workers_resume_bit_for_bit(tmp_path, workers, persistent):
    straight = train(tmp_path / "straight", workers, persistent)
    train(tmp_path / "run", workers, persistent, stop_at=4)  # mid-epoch 0 (6 steps an epoch)
    resumed = train(tmp_path / "run", workers, persistent)
    assert resumed.state.resumed_from and resumed.state.global_step == 10
    assert_same_training(straight, resumed)


def test_a_batchs_draws_follow_from_the_batch_not_the_worker():
    """The same batches, fetched by 1 or 3 workers, hold the same noise; the next epoch's
    batches of the same items hold other noise."""

    def epoch_batches(workers: int, epoch: int) -> list[torch.Tensor]:
        loader = build_dataloader(
            NoisyPoints(), batch_size=8, collate_fn=Diffusion(), seed=3, num_workers=workers
        )
        loader.set_epoch(epoch)
        return [batch["noisy"] for batch in loader]

    one, three = epoch_batches(1, 0), epoch_batches(3, 0)
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(one, epoch_batches(1, 1), strict=True))


@pytest.mark.slow
@pytest.mark.integration
def test_draws_in_workers_resume_bit_for_bit_on_two_processes(tmp_path):
    script = Path(__file__).with_name("worker_randomness_script.py")
    assert "identical" in run_torchrun(script, str(tmp_path))


class ParentDeathSignal(Dataset):
    """Each item is the signal the kernel sends the process that fetches it when its parent
    dies (``prctl(PR_GET_PDEATHSIG)``; 0: none)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        found = ctypes.c_int(0)
        assert libc.prctl(2, ctypes.byref(found), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
        return found.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_loader_workers_die_with_the_process_that_started_them():
    """A rank killed with SIGKILL leaves no loader worker behind holding the run's lock: the
    kernel kills each worker when its parent dies (torch's own watchdog takes seconds)."""
    loader = build_dataloader(ParentDeathSignal(), batch_size=4, shuffle=False, num_workers=2)
    assert {int(v) for batch in loader for v in batch} == {signal.SIGKILL}


def test_the_same_items_draw_anew_in_another_epoch_and_on_another_rank():
    """The seed of a batch fetched in a worker holds the epoch and the rank: the very same
    items (no shuffle) draw other noise in epoch 1 than in epoch 0, and on rank 1 than on
    rank 0; the same epoch and rank draw the same again."""
    from torch.utils.data import DataLoader

    from forge.data.loader import WorkerSeededBatches
    from forge.data.sampler import EpochIndex

    def noise(epoch: int, rank: int) -> torch.Tensor:
        batches = [[EpochIndex(i, epoch) for i in range(8)]]
        dataset = WorkerSeededBatches(NoisyPoints(), seed=3, rank=rank)
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=Diffusion(), num_workers=1)
        (batch,) = list(loader)
        return batch["noise"]

    first = noise(0, 0)
    assert torch.equal(first, noise(0, 0))
    assert not torch.equal(first, noise(1, 0))
    assert not torch.equal(first, noise(0, 1))

    def loader_noise(epoch: int) -> list[torch.Tensor]:
        loader = build_dataloader(
            NoisyPoints(), batch_size=8, collate_fn=Diffusion(), seed=3, shuffle=False,
            num_workers=1,
        )  # fmt: skip
        loader.set_epoch(epoch)
        return [batch["noise"] for batch in loader]

    zero, one = loader_noise(0), loader_noise(1)
    assert not any(torch.equal(a, b) for a, b in zip(zero, one, strict=True))
