"""Length-grouped and token-budget batches resume exactly: a run of `forge train` killed with
SIGKILL mid-epoch after a checkpoint and continued with `forge resume` ends with the weights and
optimizer state of the same run trained straight, on 1 process and (``-m slow``) 2; the
options' refusals are located."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest

from forge.checkpoint import read_manifest
from forge.train import Trainer, TrainingArgumentsError
from tests.helpers import REPO, run_forge
from tests.integration.test_train_resume import start_held
from tests.train.common import assert_same_tensors, component_state, make_args

DATA_PY = '''
import random

import torch
from torch import nn
from torch.utils.data import Dataset


class Sequences(Dataset):
    """96 token sequences (24 batches of 4 an epoch; 30 steps cross into epoch 1) of 3 to 24 tokens; labels are the ids."""

    def __init__(self) -> None:
        draw = random.Random(0)
        self.ids = [
            torch.tensor([draw.randrange(1, 50) for _ in range(draw.randint(3, 24))])
            for _ in range(96)
        ]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        loss = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return {"loss": loss, "logits": logits}


def tiny_llama():
    """A model the pipeline trainer splits (a transformers Llama: its preset names the parts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )
    return LlamaForCausalLM(config)
'''

CONFIG = """\
-- extends 'base.yaml'
-- block model
model: &model !partial:./data.py:{{ model | default("TinyLM") }} []
-- endblock
-- block datasets
train_dataset: &train_dataset !singleton:./data.py:Sequences []
eval_dataset: &eval_dataset null
-- endblock
-- block collator
data_collator: &data_collator !singleton:forge.data:CausalLMCollator
    pad_token_id: 0
-- endblock
-- block trainer_args
    == super()
    max_steps: 30
    save_steps: 5
    logging_steps: 4
    learning_rate: 0.01
    per_device_train_batch_size: 4
    dataloader_drop_last: true
-- endblock
"""

#: the batches of each case (the budget: about 6 items of 12 tokens a batch)
CASES = {
    "grouped": ["--set", "trainer.args.train_sampling_strategy=group_by_length"],
    "budget": ["--set", "trainer.args.max_tokens_per_batch=72"],
}


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "varlen"
    (root / "templates" / "configs").mkdir(parents=True)
    (root / "meta.yaml").write_text("name: varlen\ndescription: lengths\ndefault_config: lm\n")
    (root / "data.py").write_text(textwrap.dedent(DATA_PY))
    (root / "templates" / "configs" / "lm.yaml").write_text(CONFIG)
    return root


def final_state(run_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    checkpoint = run_dir / "checkpoints" / "checkpoint-000030"
    return load_file(checkpoint / "model.safetensors"), component_state(checkpoint, "optimizer")


def kill_and_resume(project: Path, extra: list[str]) -> tuple[Path, Path]:
    straight = run_forge("train", "-p", str(project), *extra)
    assert straight.returncode == 0, straight.stderr
    proc, run_dir = start_held("train", "-p", str(project), *extra, cwd=REPO, saved=5)
    proc.send_signal(signal.SIGKILL)  # forge's launcher dies; its workers die with it
    proc.wait(timeout=300)
    assert not (run_dir / "checkpoints" / "checkpoint-000030").exists()
    resumed = run_forge("resume", "-p", str(project), "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    return Path(straight.stdout.splitlines()[0]), run_dir


def assert_same_run(straight: Path, resumed: Path) -> None:
    weights_a, optim_a = final_state(straight)
    weights_b, optim_b = final_state(resumed)
    assert_same_tensors(weights_a, weights_b, "weights")
    assert_same_tensors(optim_a, optim_b, "optimizer")


@pytest.mark.integration
@pytest.mark.parametrize("case", ["grouped", pytest.param("budget", marks=pytest.mark.slow)])
def test_sigkill_mid_epoch_and_resume_is_bit_identical(project, case):
    assert_same_run(*kill_and_resume(project, CASES[case]))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", ["grouped", "budget"])
def test_sigkill_mid_epoch_and_resume_is_bit_identical_on_two_processes(project, case):
    straight, resumed = kill_and_resume(project, [*CASES[case], "--nproc", "2"])
    assert_same_run(straight, resumed)
    assert (resumed / "checkpoints" / "checkpoint-000030" / "data-rank-00001.pt").exists()


def test_refusals_are_located(tmp_path):
    """Items with no length, and a budget for the pipeline trainer, name the key to change."""
    from forge.train.args.pipeline import PipelineTrainingArguments

    texts = [{"text": "no ids"}] * 4
    args = make_args(
        tmp_path, train_sampling_strategy="group_by_length", remove_unused_columns=False
    )
    trainer = Trainer(lambda: None, args, texts, data_collator=lambda items: items)
    with pytest.raises(TrainingArgumentsError) as info:
        trainer.build_train_loader()
    assert "trainer.args.train_sampling_strategy: " in str(info.value)
    assert "set length_column_name to the column" in str(info.value)
    with pytest.raises(TrainingArgumentsError, match=r"trainer.args.max_tokens_per_batch: the pip"):
        PipelineTrainingArguments(output_dir=str(tmp_path), max_tokens_per_batch=512)


def test_num_items_in_batch_counts_the_real_tokens_of_budget_batches(tmp_path):
    """A step of token-budget batches (different shapes) gives a ``compute_loss_func`` the
    label tokens of its items, padding left out: every token weighs the same."""
    import torch

    from forge.data import CausalLMCollator
    from forge.data.loader import build_dataloader
    from forge.train.loss import TrainingLoss

    items = [{"input_ids": torch.arange(1, n + 1)} for n in (3, 9, 5, 12, 7, 4, 10, 6)]
    lengths = [len(item["input_ids"]) for item in items]
    loader = build_dataloader(
        items, batch_size=1, collate_fn=CausalLMCollator(), lengths=lengths, max_tokens=24
    )
    window = list(loader)[:2]
    assert window[0]["input_ids"].shape != window[1]["input_ids"].shape
    loss = TrainingLoss(lambda outputs, labels, num_items_in_batch: 0, make_args(tmp_path), print)
    counted = loss.num_items_in_batch(window, torch.nn.Linear(1, 1))
    real = sum(int(batch["attention_mask"].sum()) for batch in window)
    assert int(counted) == real  # the model shifts no labels here: every real token counts


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", ["grouped", "budget"])
def test_sigkill_mid_epoch_and_resume_is_bit_identical_under_fsdp(project, case):
    """The same on 2 processes with `fsdp: full_shard`: each rank's rows of the weights and
    of the optimizer state end where the straight run's do."""
    from forge.checkpoint.registry import read_component_states
    from forge.checkpoint.sharded import merge_sharded
    from forge.checkpoint.weights import read_weights

    fsdp = ["--set", "trainer.args.fsdp=full_shard", "--nproc", "2"]
    straight, resumed = kill_and_resume(project, [*CASES[case], *fsdp])
    a, b = (run / "checkpoints" / "checkpoint-000030" for run in (straight, resumed))
    assert read_manifest(b).components["model"]["scope"] == "sharded"
    assert_same_tensors(read_weights(a), read_weights(b), "weights")
    optimizer = [merge_sharded(read_component_states(c, "optimizer")) for c in (a, b)]
    assert_same_tensors(*optimizer, "optimizer")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize(
    "run",
    # the pipeline trains a Llama (a GRU has no stages) and refuses token budgets
    [
        "grouped-hsdp",
        "budget-hsdp",
        "grouped-accelerate",
        "budget-accelerate",
        "grouped-pipeline",
        "grouped-ppfsdp",
    ],
)
def test_sigkill_mid_epoch_and_resume_is_bit_identical_under_other_strategies(project, run):
    """The same under HSDP (2 replicas x 2 shards), the Accelerate trainer, the pipeline (2
    stages) and pipeline x FSDP (2 stages x 2 shards): every rank's file of the weights and
    of the optimizer state ends as the straight run's."""
    from tests.integration.strategies import STRATEGIES, assert_same_end, sigkill_and_resume

    case, strategy = run.split("-")
    model = ["-D", "model=tiny_llama"] if strategy.startswith("p") else []
    arguments = ["-p", str(project), *CASES[case], *model, *STRATEGIES[strategy]]
    straight, resumed, _ = sigkill_and_resume(arguments, REPO, saved=5, last=30)
    assert_same_end(straight, resumed)
    assert read_manifest(resumed).topology["world_size"] == int(STRATEGIES[strategy][1])
