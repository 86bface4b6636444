"""A user's own module wrapping a transformers model (and carrying its config as ``config``),
trained by one process and by two pipeline stages through the real entry point: one model, one
answer. Neither checkpoint claims to be a Hugging Face directory, both record the same model,
and `forge export` of either writes the inner Llama, which from_pretrained loads in full;
`forge evaluate` and `forge predict` use either through its run's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_forge
from tests.plain_project import write_project

pytestmark = pytest.mark.integration


def train(root: Path, config: str, *extra: str) -> Path:
    result = run_forge("train", config, "-p", str(root), *extra)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.splitlines()[0]) / "checkpoints" / "checkpoint-000004"


@pytest.mark.slow  # fast representatives: tests/checkpoint/test_hf_directory.py, test_export.py
def test_a_wrapper_trained_by_one_and_two_stages_exports_its_transformers_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from forge.checkpoint import load_model_weights
    from tests.cli.test_predict import project_module

    root = write_project(tmp_path / "plain")
    checkpoints = {
        "one": train(root, "wrapped"),
        "two": train(root, "wrapped_pipeline", "--nproc", "2"),
    }
    records = {}
    for name, ckpt in checkpoints.items():
        assert not (ckpt / "config.json").exists(), name  # the names are the wrapper's
        records[name] = json.loads((ckpt / "manifest.json").read_text())["model"]
    assert records["one"] == records["two"]
    assert records["one"]["hf_submodule"] == "lm"
    assert records["one"]["hf_config"]["architectures"] == ["LlamaForCausalLM"]

    module = project_module(checkpoints["one"].parents[1], "wrapped")
    ids = torch.randint(1, 200, (2, 10))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"text": "def add"}\n')
    for name, ckpt in checkpoints.items():
        out = tmp_path / f"export-{name}"
        result = run_forge("export", str(ckpt), str(out))
        assert result.returncode == 0, result.stderr
        assert "load it with AutoModelForCausalLM.from_pretrained" in result.stderr
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        wrapper = module.WrappedLlama(loaded.config.vocab_size)
        load_model_weights(wrapper, ckpt)
        with torch.no_grad():
            assert torch.equal(loaded.eval()(input_ids=ids).logits, wrapper.eval()(ids).logits)
        evaluated = run_forge("evaluate", str(ckpt))
        assert evaluated.returncode == 0, evaluated.stderr
        assert "eval at step 4 |" in evaluated.stderr
        predicted = run_forge(
            "predict", str(ckpt), "--input", str(inputs), "--output", str(out / "p")
        )
        assert predicted.returncode == 0, predicted.stderr
