"""A project whose models are the user's own ``nn.Module`` classes (no transformers model, no
``config.json``), trained in this process: for the commands that use a run's checkpoints."""

from __future__ import annotations

import textwrap
from pathlib import Path

MODEL_PY = '''
from types import SimpleNamespace

import torch
from torch import nn


class TinyLM(nn.Module):
    """A causal LM of its own: embedding, GRU, head; returns logits (and a loss with labels)."""

    def __init__(self, vocab_size: int, hidden: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
            )
        return out


class WrappedLlama(nn.Module):
    """A user's wrapper around a transformers causal LM, carrying its config as its own."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
        )
        self.lm = LlamaForCausalLM(self.config)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class TinyClassifier(nn.Module):
    """Mean of embeddings, then a linear layer; its labels' names in a config attribute."""

    def __init__(self, vocab_size: int, hidden: int = 16) -> None:
        super().__init__()
        self.config = SimpleNamespace(id2label={0: "low", 1: "high"})
        self.embed = nn.Embedding(vocab_size, hidden)
        self.out = nn.Linear(hidden, 2)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.embed(input_ids).mean(dim=1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out
'''

DATA_PY = '''
import torch
from torch.utils.data import Dataset

from forge.data.tokenizer import train_bpe_tokenizer

TEXTS = [
    "def add(a, b):\\n    return a + b\\n",
    "import os\\nprint(os.getcwd())\\n",
    "for i in range(10):\\n    print(i * i)\\n",
] * 8


def tokenizer():
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


class Blocks(Dataset):
    """Every text as 12 token ids; labels are the ids (the model shifts them)."""

    def __init__(self, tokenizer, labelled: bool = False) -> None:
        ids = [tokenizer(t)["input_ids"][:12] for t in TEXTS]
        self.ids = [torch.tensor(i + [0] * (12 - len(i))) for i in ids]
        self.labelled = labelled

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        if self.labelled:  # "high" when the text prints something
            return {"input_ids": self.ids[index], "labels": int("print" in TEXTS[index])}
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
'''

CONFIG = """\
-- extends 'base.yaml'
-- block tokenizer
tokenizer: &tokenizer !singleton:./data.py:tokenizer []
-- endblock
-- block model
model: &model !partial:./model.py:{model}
    vocab_size: !call:forge.data.vocab:vocab_size [*tokenizer]
-- endblock
-- block datasets
train_dataset: &train_dataset !singleton:./data.py:Blocks [*tokenizer, {labelled}]
eval_dataset: &eval_dataset !singleton:./data.py:Blocks [*tokenizer, {labelled}]
-- endblock
-- block trainer_args
    == super()
    max_steps: 4
    save_steps: 4
    eval_strategy: steps
    eval_steps: 4
    logging_steps: 2
    learning_rate: 0.01
    warmup_ratio: 0.0
    report_to: none
-- endblock
"""

PIPELINE_CONFIG = """\
-- extends 'configs/lm.yaml'
-- from 'trainers/pipeline_trainer.yaml' import trainer_class, trainer_args_class, trainer_kind, pipeline_args
-- block model
model: &model !partial:transformers:LlamaForCausalLM
    - !singleton:transformers:LlamaConfig
        vocab_size: !call:forge.data.vocab:vocab_size [*tokenizer]
        hidden_size: 16
        intermediate_size: 32
        num_hidden_layers: 2
        num_attention_heads: 2
        max_position_embeddings: 32
-- endblock
-- block collator
data_collator: &data_collator !singleton:forge.data:CausalLMCollator
    pad_token_id: 0
-- endblock
-- block trainer_args
    == super()
== pipeline_args()
-- endblock
"""


TORCH_MODEL_PY = '''
import torch
from torch import nn


def regressor(features: int = 4, hidden: int = 16) -> nn.Sequential:
    """A regressor as plain PyTorch writes it: forward(input) -> [batch, 1]."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))


class GRUClassifier(nn.Module):
    """Sequences of feature vectors [batch, steps, features] -> class logits [batch, classes]."""

    def __init__(self, features: int = 3, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.gru(x)[1][-1])
'''

TORCH_DATA_PY = '''
import torch
from torch.utils.data import Dataset


class Points(Dataset):
    """(x [4], y [1]) tuples: y is the sum of x."""

    def __init__(self, n: int = 32) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class Sequences(Dataset):
    """(x [5, 3], class) tuples."""

    def __init__(self, n: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 5, 3, generator=generator)
        self.y = torch.randint(3, (n,), generator=generator)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]
'''

TORCH_CONFIG = """\
-- extends 'base.yaml'
-- block model
model: &model !partial:./torch_model.py:{model} {{}}
-- endblock
-- block datasets
train_dataset: &train_dataset !singleton:./torch_data.py:{dataset} {{}}
eval_dataset: &eval_dataset !singleton:./torch_data.py:{dataset} {{n: 8}}
-- endblock
-- block collator
data_collator: &data_collator !singleton:forge.data:TupleCollator {{names: [{input}, labels]}}
-- endblock
-- block trainer
    == super()
    compute_loss_func: !partial:torch.nn.functional:{loss} []
-- endblock
-- block trainer_args
    == super()
    max_steps: 4
    save_steps: 4
    logging_steps: 2
    learning_rate: 0.01
    report_to: none
-- endblock
"""


WRAPPED_PIPELINE_CONFIG = """\
-- extends 'configs/wrapped.yaml'
-- from 'trainers/pipeline_trainer.yaml' import trainer_class, trainer_args_class, trainer_kind, pipeline_args
-- block collator
data_collator: &data_collator !singleton:forge.data:CausalLMCollator
    pad_token_id: 0
-- endblock
-- block trainer_args
    == super()
== pipeline_args()
    pipeline_embedding: lm.model.embed_tokens
    pipeline_layers: lm.model.layers
    pipeline_head: [lm.model.norm, lm.lm_head]
    pipeline_rotary: lm.model.rotary_emb
-- endblock
"""


def write_project(root: Path) -> Path:
    """The project: configs ``lm`` (TinyLM), ``cls`` (TinyClassifier), ``pipeline`` (a Llama
    under the pipeline trainer), ``wrapped`` (WrappedLlama), ``wrapped_pipeline`` (it under
    the pipeline trainer), and, without a tokenizer, ``regress`` (an ``nn.Sequential``
    regressor on tuples) and ``gru`` (a GRU classifier of feature sequences)."""
    configs = root / "templates" / "configs"
    configs.mkdir(parents=True)
    (root / "meta.yaml").write_text("name: plain\ndescription: own modules\ndefault_config: lm\n")
    (root / "model.py").write_text(textwrap.dedent(MODEL_PY))
    (root / "data.py").write_text(textwrap.dedent(DATA_PY))
    (configs / "lm.yaml").write_text(CONFIG.format(model="TinyLM", labelled="false"))
    (configs / "cls.yaml").write_text(CONFIG.format(model="TinyClassifier", labelled="true"))
    (configs / "pipeline.yaml").write_text(PIPELINE_CONFIG)
    (configs / "wrapped.yaml").write_text(CONFIG.format(model="WrappedLlama", labelled="false"))
    (configs / "wrapped_pipeline.yaml").write_text(WRAPPED_PIPELINE_CONFIG)
    (root / "torch_model.py").write_text(textwrap.dedent(TORCH_MODEL_PY))
    (root / "torch_data.py").write_text(textwrap.dedent(TORCH_DATA_PY))
    regress = {"model": "regressor", "dataset": "Points", "input": "input", "loss": "mse_loss"}
    (configs / "regress.yaml").write_text(TORCH_CONFIG.format(**regress))
    gru = {"model": "GRUClassifier", "dataset": "Sequences", "input": "x", "loss": "cross_entropy"}
    (configs / "gru.yaml").write_text(TORCH_CONFIG.format(**gru))
    return root


def train_in_process(root: Path, config: str, overrides: list[str] = ()) -> Path:
    """Train ``config`` of the project at ``root`` here, as ``forge train`` does for one
    process; returns the run directory."""
    from forge.config import load_config, load_project
    from forge.launch.worker import run_worker
    from forge.runs import config_output_dir, create_run

    project = load_project(root)
    cfg = load_config(project, config, variables={}, overrides=list(overrides))
    run_dir = create_run(
        config_output_dir(project.output_dir, config),
        config_name=config,
        config_text=cfg.text,
        project_root=project.root,
        overrides=list(overrides),
        variables={},
        nproc=1,
    )
    run_worker(run_dir, project)
    return run_dir
