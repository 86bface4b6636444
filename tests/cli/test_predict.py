"""forge.read.predict on Hugging Face model directories: a causal LM continues each input, a model
that is neither a classifier nor a generating model is refused, and inputs are read with located
errors; lines of model inputs serve models without a tokenizer, and a seq2seq model generates. (A classifier's labels are tested end to end in tests/cli/test_evaluate_predict.py.)"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from forge.data.tokenizer import train_bpe_tokenizer
from forge.read.errors import ReadFailure, ReadUsageError
from forge.read.predict import read_inputs
from forge.read.reader import CheckpointReader

TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 20


def relist(checkpoint):
    """Rewrite ``checkpoint``'s manifest to list the files it holds now (sizes, hashes), the
    model's files as the model component's: a checkpoint a test changed, valid again."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    model = manifest["components"]["model"]
    present = {p.name for p in checkpoint.iterdir() if p.name != "manifest.json"}
    for name in list(manifest["files"]):
        if name not in present:
            del manifest["files"][name]
    for name in sorted(present - set(manifest["files"])):
        written = (checkpoint / name).read_bytes()
        manifest["files"][name] = {
            "size": len(written),
            "sha256": hashlib.sha256(written).hexdigest(),
        }
        model["files"].append(name)
    model["files"] = [name for name in model["files"] if name in present]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


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
    count = CheckpointReader(causal_lm_dir).predict(
        inputs, output, text_field="prompt", batch_size=2, max_new_tokens=5
    )
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert count == 2 and [r["prompt"] for r in rows] == ["def ", "import"]
    assert all(isinstance(r["prediction"], str) and r["prediction"] for r in rows)
    CheckpointReader(causal_lm_dir).predict(
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
    with pytest.raises(ReadUsageError, match="holds a BertModel; forge predict handles sequence"):
        CheckpointReader(tmp_path).predict(tmp_path / "in.jsonl", tmp_path / "out.jsonl")


def test_inputs_are_read_with_located_errors(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a"}\n\n"b"\n{"text": 3}\n')
    with pytest.raises(ReadUsageError, match=r"in.jsonl:4: needs a string field 'text'"):
        read_inputs(path, "text")
    path.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ReadFailure, match=r"in.jsonl:2: not a JSON line"):
        read_inputs(path, "text")
    path.write_text('{"text": "a"}\n"b"\n')
    assert read_inputs(path, "text") == [{"text": "a"}, {"text": "b"}]


# ---------------------------------------------------------------------------------------------
# a model of the user's own (no transformers model, no config.json): built from its run's config


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    from tests.plain_project import train_in_process, write_project

    root = write_project(tmp_path_factory.mktemp("plain") / "plain")
    return {config: train_in_process(root, config) for config in ("lm", "cls", "pipeline")}


def newest(run_dir):
    return run_dir / "checkpoints" / "checkpoint-000004"


def project_module(run_dir, name):
    """The project's own model.py, imported from its file (the oracle's copy of the class)."""
    import importlib.util

    path = run_dir.parents[2] / "model.py"
    spec = importlib.util.spec_from_file_location(f"plain_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trained(run_dir, class_name):
    """The run's model rebuilt by hand, with the checkpoint's tensors."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    ckpt = newest(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = getattr(project_module(run_dir, class_name), class_name)(len(tokenizer))
    model.load_state_dict(load_file(ckpt / "model.safetensors"))
    return model.eval(), tokenizer


def greedy(model, tokenizer, text, n):
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=ids)["logits"][0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


def test_a_plain_causal_lm_is_built_from_its_run_and_continues_each_text(plain_runs, tmp_path):

    run_dir = plain_runs["lm"]
    ckpt = newest(run_dir)
    assert not (ckpt / "config.json").exists()
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"text": "def add"}\n"import os"\n')
    CheckpointReader(ckpt).predict(inputs, tmp_path / "out.jsonl", max_new_tokens=4)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model, tokenizer = trained(run_dir, "TinyLM")
    for row in rows:
        expected = greedy(model, tokenizer, row["text"], 4)
        assert row["prediction"] == tokenizer.decode(expected, skip_special_tokens=True)
    [text] = CheckpointReader(ckpt).generate("def add", max_new_tokens=4, temperature=0.0)
    ids = tokenizer("def add")["input_ids"]
    assert text == tokenizer.decode(ids + greedy(model, tokenizer, "def add", 4))
    # a config.json that does not name the weights (as older pipeline checkpoints of wrappers
    # had) is not trusted: the model is still the run's, not an untrained transformers one
    import shutil

    from tests.checkpoint.checkpoint_helpers import tiny_gpt2

    other_run = run_dir.with_name("run_099")  # a copy of the run, its checkpoint given one
    shutil.copytree(run_dir, other_run)
    other = other_run / "checkpoints" / ckpt.name
    tiny_gpt2().config.save_pretrained(other)
    relist(other)  # listed in its manifest, so it is a valid checkpoint
    CheckpointReader(other).predict(inputs, tmp_path / "again.jsonl", max_new_tokens=4)
    assert (tmp_path / "again.jsonl").read_text() == (tmp_path / "out.jsonl").read_text()


def test_a_plain_classifier_labels_each_input_with_its_own_label_names(plain_runs, tmp_path):
    run_dir = plain_runs["cls"]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text('{"text": "print(i * i)", "id": 1}\n{"text": "def add(a, b)", "id": 2}\n')
    CheckpointReader(newest(run_dir)).predict(inputs, tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model, tokenizer = trained(run_dir, "TinyClassifier")
    for row in rows:
        with torch.no_grad():
            logits = model(input_ids=tokenizer(row["text"], return_tensors="pt")["input_ids"])
        probs = torch.softmax(logits["logits"][0], dim=-1)
        assert row["prediction"] == ["low", "high"][int(probs.argmax())]
        assert row["score"] == pytest.approx(probs.max().item(), abs=1e-6)
    assert [r["id"] for r in rows] == [1, 2]


@pytest.mark.parametrize("config", ["lm", "pipeline"])
def test_evaluate_gives_the_checkpoints_metrics_at_its_step(plain_runs, config, caplog):
    from forge.checkpoint import read_manifest

    ckpt = newest(plain_runs[config])
    saved = read_manifest(ckpt).metrics  # the evaluation at step 4, before this save
    with caplog.at_level(logging.INFO):
        metrics = CheckpointReader(ckpt).evaluate()
    assert metrics["eval_loss"] == pytest.approx(saved["eval_loss"], rel=1e-5)
    assert "eval at step 4 |" in caplog.text and "eval at step 0" not in caplog.text


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """lm trained with a moving average of its weights, evaluated with it (eval_with_ema)."""
    from tests.plain_project import train_in_process, write_project

    root = write_project(tmp_path_factory.mktemp("plain_ema") / "plain")
    return train_in_process(
        root, "lm", ["trainer.args.ema_decay=0.9", "trainer.args.eval_with_ema=true"]
    )


def test_evaluate_says_which_weights_it_evaluates(ema_run, plain_runs, caplog):
    """The run reported the average's eval_loss (eval_with_ema): evaluate without --ema says it
    evaluates the trained weights, which give another loss, and names --ema; with --ema it
    says it evaluates the average and gives the run's number."""
    from forge.checkpoint import read_manifest

    ckpt = newest(ema_run)
    reported = read_manifest(ckpt).metrics["eval_loss"]
    with caplog.at_level(logging.INFO):
        trained_loss = CheckpointReader(ckpt).evaluate()["eval_loss"]
    assert trained_loss != pytest.approx(reported, rel=1e-5)
    assert "evaluating its trained weights, not the moving average of the weights" in caplog.text
    assert "eval_with_ema" in caplog.text and "--ema evaluates the average" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert CheckpointReader(ckpt).evaluate(ema=True)["eval_loss"] == pytest.approx(
            reported, rel=1e-5
        )
    assert "evaluating the moving average of the weights it holds (--ema)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):  # a run without an average: its weights, said plainly
        CheckpointReader(newest(plain_runs["lm"])).evaluate()
    assert "evaluating its trained weights" in caplog.text and "--ema" not in caplog.text


def test_the_commands_name_a_project_class_by_its_file(plain_runs, tmp_path):
    """A class of a project file is named as the user wrote it (model.py:TinyLM), never by
    the module name forge loads the file under; a refusal is exit 2."""
    from forge.checkpoint import read_manifest
    from tests.helpers import run_forge

    ckpt = newest(plain_runs["lm"])
    assert read_manifest(ckpt).extra["model"]["class"] == "model.py:TinyLM"
    refused = run_forge("export", str(ckpt), str(tmp_path / "sub"), "--submodule", "rnn")
    assert refused.returncode == 2, refused.stderr
    assert "model (model.py:TinyLM) holds no transformers model" in refused.stderr
    exported = run_forge("export", str(ckpt), str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    assert "of the model (model.py:TinyLM) of" in exported.stderr
    for output in (refused.stderr, exported.stderr):
        assert "forge_project_file" not in output


# ---------------------------------------------------------------------------------------------
# lines of model inputs: models without a tokenizer


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """An nn.Sequential regressor and a GRU classifier, written for plain PyTorch (tuple items,
    compute_loss_func), trained without a tokenizer."""
    from tests.plain_project import train_in_process, write_project

    root = write_project(tmp_path_factory.mktemp("torch") / "plain")
    return {config: train_in_process(root, config) for config in ("regress", "gru")}


def torch_model(run_dir, name):
    """The class or builder ``name`` of the project's torch_model.py, built, with the
    checkpoint's tensors (the oracle's copy)."""
    import importlib.util

    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location(
        "torch_model", run_dir.parents[2] / "torch_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = getattr(module, name)()
    model.load_state_dict(load_file(newest(run_dir) / "model.safetensors"))
    return model.eval()


def write_lines(path, *rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_plain_pytorch_models_predict_from_lines_of_their_inputs(torch_runs, tmp_path):
    """Neither model has a tokenizer; each line is one example under forward's name, and the
    prediction is what predict gives for text rows: a regressor's value, a class and score."""
    run_dir = torch_runs["regress"]
    assert not (newest(run_dir) / "tokenizer.json").exists()
    inputs = write_lines(
        tmp_path / "x.jsonl", {"input": [1.0, 2.0, 3.0, 4.0]}, {"input": [0, 0, 1, 0]}
    )
    CheckpointReader(newest(run_dir)).predict(inputs, tmp_path / "out.jsonl")
    rows = read_lines(tmp_path / "out.jsonl")
    model = torch_model(run_dir, "regressor")
    with torch.no_grad():  # [0, 0, 1, 0] beside floats is floats too
        expected = model(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 0.0]]))[:, 0]
    assert [r["input"] for r in rows] == [[1.0, 2.0, 3.0, 4.0], [0, 0, 1, 0]]
    assert [r["prediction"] for r in rows] == pytest.approx(expected.tolist(), abs=1e-6)

    run_dir = torch_runs["gru"]
    steps = [[[0.5, -1.0, 2.0], [1.0, 0.0, 0.25]], [[0.0, 0.0, 0.0]]]  # two lengths
    inputs = write_lines(tmp_path / "seq.jsonl", *({"x": x} for x in steps))
    CheckpointReader(newest(run_dir)).predict(inputs, tmp_path / "gru.jsonl")
    model = torch_model(run_dir, "GRUClassifier")
    for row, x in zip(read_lines(tmp_path / "gru.jsonl"), steps, strict=True):
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([x]))[0], dim=-1)
        assert row["prediction"] == int(probs.argmax())
        assert row["score"] == pytest.approx(probs.max().item(), abs=1e-6)


def test_a_wrong_key_or_text_without_a_tokenizer_is_refused_at_once(torch_runs, tmp_path):
    """Exit 2 before any line runs: the key and the forward's parameters, or what to give in
    place of text; a line the model cannot take is located, exit 1."""
    import time

    from tests.helpers import run_forge

    ckpt = newest(torch_runs["gru"])
    inputs = write_lines(tmp_path / "in.jsonl", {"x": [[1.0, 2.0, 3.0]]}, {"features": [[1.0]]})
    started = time.monotonic()
    refused = run_forge("predict", str(ckpt), "--input", str(inputs), "--output", "o.jsonl")
    assert time.monotonic() - started < 60
    assert refused.returncode == 2, refused.stderr
    assert "in.jsonl:2: torch_model.py:GRUClassifier.forward(x) takes no 'features'" in (
        refused.stderr
    )
    assert "Traceback" not in refused.stderr
    text = write_lines(tmp_path / "text.jsonl", {"text": "hello"})
    refused = run_forge("predict", str(ckpt), "--input", str(text), "--output", "o.jsonl")
    assert refused.returncode == 2, refused.stderr
    assert "holds no tokenizer" in refused.stderr and "torch_model.py:GRUClassifier" in (
        refused.stderr
    )
    assert '{"input_ids": [1, 2, 3]}' in refused.stderr
    refused = run_forge("generate", str(ckpt), "--prompt", "hello")
    assert refused.returncode == 2, refused.stderr
    assert "holds no tokenizer" in refused.stderr and "forge predict" in refused.stderr
    short = write_lines(tmp_path / "short.jsonl", {"x": [[1.0, 2.0]]})
    with pytest.raises(ReadFailure, match=r"short.jsonl:1: the model failed on this line"):
        CheckpointReader(ckpt).predict(short, tmp_path / "o.jsonl")
    mixed = write_lines(tmp_path / "mixed.jsonl", {"x": [[1.0, 2.0, 3.0]]}, {"text": "a"})
    with pytest.raises(ReadUsageError, match=r"mixed.jsonl:2: a row of text \(text\) after rows"):
        read_inputs(mixed, "text")
    named = write_lines(tmp_path / "named.jsonl", {"review": "good"})  # text under another name
    with pytest.raises(ReadUsageError, match=r"named.jsonl:1: needs a string field 'text'"):
        read_inputs(named, "text")


def greedy_ids(model, ids, n, eos):
    """The ids a causal LM adds to ``ids``, greedily, stopping at ``eos``."""
    ids, new = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(n):
            output = model(input_ids=ids)
            logits = output["logits"] if isinstance(output, dict) else output.logits
            token = int(logits[0, -1].argmax())
            if token == eos:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


def test_a_causal_lm_continues_input_ids_without_a_tokenizer(causal_lm_dir, plain_runs, tmp_path):
    """A transformers causal LM (a model directory with no tokenizer) and a module of the
    user's own (a run's checkpoint without its tokenizer files) add token ids to each line's."""
    import shutil

    directory = tmp_path / "lm"
    shutil.copytree(
        causal_lm_dir, directory, ignore=shutil.ignore_patterns("tokenizer*", "special*")
    )
    inputs = write_lines(tmp_path / "ids.jsonl", {"input_ids": [5, 6, 7]}, {"input_ids": [9]})
    CheckpointReader(directory).predict(inputs, tmp_path / "out.jsonl", max_new_tokens=5)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(causal_lm_dir).eval()
    for row in read_lines(tmp_path / "out.jsonl"):
        assert row["prediction"] == greedy_ids(
            model, row["input_ids"], 5, model.config.eos_token_id
        )

    run_dir = plain_runs["lm"].with_name("run_098")  # a copy of the run, without tokenizer files
    shutil.copytree(
        plain_runs["lm"], run_dir, ignore=shutil.ignore_patterns("tokenizer*", "special*")
    )
    ckpt = newest(run_dir)
    relist(ckpt)
    CheckpointReader(ckpt).predict(inputs, tmp_path / "tiny.jsonl", max_new_tokens=4)
    tiny, _ = trained(plain_runs["lm"], "TinyLM")
    for row in read_lines(tmp_path / "tiny.jsonl"):
        assert row["prediction"] == greedy_ids(tiny, row["input_ids"], 4, None)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    """A T5ForConditionalGeneration model directory (random weights), without a tokenizer."""
    from transformers import T5Config, T5ForConditionalGeneration

    directory = tmp_path_factory.mktemp("t5")
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    config = T5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(directory)
    return directory, tokenizer


def greedy_decoder(model, ids, n):
    """What an encoder-decoder writes for ``ids``, greedily, without its start token."""
    config = model.config
    written = torch.tensor([[config.decoder_start_token_id]])
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids]), decoder_input_ids=written).logits
            token = int(logits[0, -1].argmax())
            if token == config.eos_token_id:
                break
            written = torch.cat([written, torch.tensor([[token]])], dim=1)
    return written[0, 1:].tolist()


def test_a_seq2seq_model_generates_and_without_a_tokenizer_is_told_what_to_use(t5_dir, tmp_path):
    """The prompt is the encoder's input. Without a tokenizer forge generate is refused (exit
    2, naming the class and forge predict), and forge predict writes the ids it generates from
    lines of input_ids; with one, both write text."""
    import shutil

    from transformers import T5ForConditionalGeneration

    from tests.helpers import run_forge

    directory, tokenizer = t5_dir
    refused = run_forge("generate", str(directory), "--prompt", "def ")
    assert refused.returncode == 2, refused.stderr
    assert "holds no tokenizer" in refused.stderr
    assert "T5ForConditionalGeneration" in refused.stderr and "forge predict" in refused.stderr
    model = T5ForConditionalGeneration.from_pretrained(directory).eval()
    inputs = write_lines(tmp_path / "ids.jsonl", {"input_ids": [5, 6, 7]}, {"input_ids": [9, 3]})
    done = run_forge(
        "predict", str(directory), "--input", str(inputs), "--output", str(tmp_path / "o.jsonl"),
        "--max-new-tokens", "6",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in read_lines(tmp_path / "o.jsonl"):
        assert row["prediction"] == greedy_decoder(model, row["input_ids"], 6)

    with_tokenizer = tmp_path / "t5"
    shutil.copytree(directory, with_tokenizer)
    tokenizer.save_pretrained(with_tokenizer)
    ids = tokenizer("def add")["input_ids"]
    expected = tokenizer.decode(greedy_decoder(model, ids, 6), skip_special_tokens=True)
    assert CheckpointReader(with_tokenizer).generate(
        "def add", max_new_tokens=6, temperature=0.0
    ) == [expected]
    text = write_lines(tmp_path / "text.jsonl", {"text": "def add"})
    CheckpointReader(with_tokenizer).predict(text, tmp_path / "t.jsonl", max_new_tokens=6)
    assert read_lines(tmp_path / "t.jsonl")[0]["prediction"] == expected
