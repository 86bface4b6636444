"""Extra loss parts and metrics a model returns (any float or 0-d tensor field besides
``loss`` and ``logits``) are logged beside the loss, as means over the logging window, read
from the device only at logging steps; and peak memory is logged with them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forge.data import CausalLMCollator
from forge.train import Trainer
from forge.train.loop_state import model_metrics
from forge.train.memory import peak_memory
from tests.train.common import VOCAB, StopAtStep, TokenDataset, checkpoint_dir, make_args
from tests.train.host_reads import HostReads, quiet_steps


class MetricLM(nn.Module):
    """A next-token model that returns, besides its loss: ``aux_loss`` (a 0-d tensor of its
    batch, added to the loss), ``call`` (its training calls so far, a 0-d tensor: known
    means), ``constant`` (a float), and fields that are no metrics (a vector, an int)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, VOCAB)
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, labels=None):
        self.calls += self.training
        logits = self.head(self.drop(self.embed(input_ids)))
        task = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        aux = logits.float().pow(2).mean() * 1e-3
        return {
            "loss": task + aux,
            "logits": logits,
            "aux_loss": aux,
            "call": torch.tensor(float(self.calls)),
            "constant": 0.5,
            "per_row": input_ids.float().mean(dim=1),  # not 0-d: a prediction, not a metric
            "count": 3,  # an int: not a metric
        }


def train(output_dir, *, reads: HostReads | None = None, resume=None, stop=None, **overrides):
    values = dict(max_steps=12, logging_steps=4, gradient_accumulation_steps=2)
    values.update(save_strategy="steps", save_steps=6)
    values.update(overrides)
    collator = CausalLMCollator(pad_token_id=0)
    trainer = Trainer(
        MetricLM,
        make_args(output_dir, **values),
        TokenDataset(64),
        data_collator=reads.collator(collator) if reads else collator,
        callbacks=[reads] if reads else [StopAtStep(stop)] if stop else [],
    )
    if reads is not None:
        with reads:
            trainer.train()
    else:
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(output_dir) -> dict[int, dict]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in records if "loss" in r}


def test_model_metrics_are_window_means_logged_beside_the_loss(tmp_path):
    train(tmp_path)
    logs = logged(tmp_path)
    assert sorted(logs) == [4, 8, 12]
    # 2 micro-batches a step, 4 steps a window: calls 1-8, 9-16, 17-24
    assert [logs[s]["call"] for s in (4, 8, 12)] == [4.5, 12.5, 20.5]
    assert all(logs[s]["constant"] == 0.5 for s in logs)
    assert all(0 < logs[s]["aux_loss"] < logs[s]["loss"] for s in logs)
    assert len({logs[s]["aux_loss"] for s in logs}) == 3
    for record in logs.values():
        assert "per_row" not in record and "count" not in record and "logits" not in record
        assert record["peak_rss_mb"] > 0
        assert list(record)[:2] == ["step", "loss"]  # the loss first, the model's next


def test_no_host_read_on_quiet_steps(tmp_path):
    reads = HostReads()
    train(tmp_path, reads=reads)
    by_step = reads.by_step()
    assert {s: by_step[s] for s in quiet_steps(12, 4, 6) if s in by_step} == {}
    assert all(by_step.get(step) for step in (4, 8, 12))  # the count does see reads


def test_a_resumed_run_logs_the_same_model_metrics(tmp_path):
    """The window from step 5 to 8 spans the checkpoint at 6: its means include the steps
    before the checkpoint (saved with the tally)."""
    train(tmp_path / "straight")
    straight = logged(tmp_path / "straight")
    train(tmp_path / "resumed", stop=6)
    train(tmp_path / "resumed", resume=str(checkpoint_dir(tmp_path / "resumed", 6)))
    resumed = logged(tmp_path / "resumed")
    for step in (8, 12):
        assert resumed[step]["aux_loss"] == straight[step]["aux_loss"]
        assert resumed[step]["loss"] == straight[step]["loss"]
    # the training calls restart with the process: steps 5 and 6 counted 9-12, then 1-4
    assert resumed[8]["call"] == (9 + 10 + 11 + 12 + 1 + 2 + 3 + 4) / 8


def test_model_metrics_of_mappings_and_output_objects():
    from transformers.modeling_outputs import CausalLMOutput

    output = CausalLMOutput(loss=torch.tensor(1.0), logits=torch.zeros(2, 3))
    assert model_metrics(output) == {}

    @dataclass
    class Out:
        loss: torch.Tensor
        ponder_cost: torch.Tensor
        steps: torch.Tensor  # integer: not a mean to log

    found = model_metrics(Out(torch.tensor(1.0), torch.tensor(2.5), torch.tensor(3)))
    assert found == {"ponder_cost": torch.tensor(2.5)}
    assert model_metrics(torch.tensor(1.0)) == {} and model_metrics((1.0, 2.0)) == {}


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_peak_rss_is_the_process_peak_in_mib():
    """In a fresh process: the logged peak is the kernel's (VmHWM); touching 512 MiB raises it
    above the resident size before plus 512 MiB, and freeing them does not lower it."""
    script = (
        "import re, torch\n"
        "from forge.train.memory import peak_memory\n"
        "def status(key):\n"
        "    text = open('/proc/self/status').read()\n"
        "    return int(re.search(key + r':\\s+(\\d+) kB', text).group(1)) / 1024\n"
        "cpu = torch.device('cpu')\n"
        "resident = status('VmRSS')\n"
        "block = torch.ones(512 * 1024 * 1024, dtype=torch.uint8)\n"
        "during = peak_memory(cpu)['peak_rss_mb']\n"
        "kernel = status('VmHWM')\n"
        "del block\n"
        "after = peak_memory(cpu)['peak_rss_mb']\n"
        "print(resident, during, kernel, after)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    resident, during, kernel, after = map(float, proc.stdout.split())
    assert during == pytest.approx(kernel, abs=2)  # the kernel updates them apart
    assert during >= resident + 500
    assert after == during
    assert set(peak_memory(torch.device("cpu"))) == {"peak_rss_mb"}


class FirstTokenLM(MetricLM):
    """Returns, beside the loss, the mean first token of its batch: a value known per item."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        outputs = super().forward(input_ids, attention_mask, labels)
        return {**outputs, "first_token": input_ids[:, 0].float().mean()}


def test_evaluation_reports_the_models_scalar_outputs_as_eval_metrics(tmp_path):
    """Any model's scalar outputs besides the loss are averaged over the evaluation's batches,
    each weighed as its loss is (here by its label tokens), and reported as ``eval_NAME``:
    batches of 8, 8 and 4 items give the mean over the 20 items, not over the 3 batches."""
    dataset = TokenDataset(20, seed=1)
    trainer = Trainer(
        FirstTokenLM,
        make_args(tmp_path, max_steps=2, per_device_eval_batch_size=8),
        TokenDataset(16),
        eval_dataset=dataset,
        data_collator=CausalLMCollator(pad_token_id=0),
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_first_token"] == pytest.approx(dataset.ids[:, 0].double().mean().item())
    assert metrics["eval_constant"] == 0.5
    assert "eval_per_row" not in metrics and "eval_count" not in metrics
    assert 0 < metrics["eval_aux_loss"] < metrics["eval_loss"]
