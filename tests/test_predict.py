"""forge.predict on Hugging Face model directories: a causal LM continues each input, a model
that is neither a classifier nor a causal LM is refused, and inputs are read with located
errors. (A classifier's labels are tested end to end in tests/cli/test_evaluate_predict.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from forge.data.tokenizer import train_bpe_tokenizer
from forge.errors import RuntimeFailure, UsageError
from forge.predict import predict_file, read_inputs

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20


@pytest.fixture(scope="module")
def causal_lm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm")
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_causal_lm_continues_each_text_greedily(causal_lm_dir, tmp_path):
    inputs = tmp_path / "prompts.jsonl"
    inputs.write_text(
        json.dumps({"prompt": "def "}) + "\n" + json.dumps({"prompt": "import"}) + "\n"
    )
    output = tmp_path / "out.jsonl"
    count = predict_file(
        causal_lm_dir, inputs, output, text_field="prompt", batch_size=2, max_new_tokens=5
    )
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert count == 2 and [r["prompt"] for r in rows] == ["def ", "import"]
    assert all(isinstance(r["prediction"], str) and r["prediction"] for r in rows)
    predict_file(
        causal_lm_dir,
        inputs,
        tmp_path / "again.jsonl",
        text_field="prompt",
        batch_size=1,
        max_new_tokens=5,
    )
    # greedy and left-padded: a row's continuation does not depend on its batch
    assert (tmp_path / "again.jsonl").read_text() == output.read_text()


def test_a_model_that_neither_classifies_nor_generates_is_refused(tmp_path):
    BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    ).save_pretrained(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UsageError, match="holds a BertModel; forge predict handles sequence"):
        predict_file(tmp_path, tmp_path / "in.jsonl", tmp_path / "out.jsonl")


def test_inputs_are_read_with_located_errors(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a"}\n\n"b"\n{"text": 3}\n')
    with pytest.raises(UsageError, match=r"in.jsonl:4: needs a string field 'text'"):
        read_inputs(path, "text")
    path.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(RuntimeFailure, match=r"in.jsonl:2: not a JSON line"):
        read_inputs(path, "text")
    path.write_text('{"text": "a"}\n"b"\n')
    assert read_inputs(path, "text") == [{"text": "a"}, {"text": "b"}]
