"""The Python API (forge/api.py) and the read side (forge/read/reader.py): render and build
from Python, train and resume in this process, and ``forge.load``'s model giving bit for bit
the logits ``forge evaluate``'s code path computes from the same checkpoint (a plain module,
a Hugging Face model, a LoRA run's best checkpoint merged and not, a moving average; the best
checkpoints of an FSDP run and of a pipeline run with a moving average, of 2 processes each, in
the slow tests)."""

from __future__ import annotations

import json

import pytest
import torch

import forge
from forge.config import ConfigError
from tests.helpers import run_forge, run_python
from tests.plain_project import PIPELINE_CONFIG, write_project

# a LlamaForCausalLM in place of lm.yaml's TinyLM: the pipeline config's model block
_MODEL_BLOCK = PIPELINE_CONFIG[
    PIPELINE_CONFIG.index("-- block model") : PIPELINE_CONFIG.index("-- block collator")
]
HF_CONFIG = "-- extends 'configs/lm.yaml'\n" + _MODEL_BLOCK

LORA_CONFIG = """\
-- extends 'configs/hf.yaml'
-- import 'trainers/lora.yaml' as lora with context
-- block model
== lora.model()
-- endblock
-- block trainer
    == super()
== lora.peft_config()
-- endblock
"""

EMA = ["trainer.args.ema_decay=0.5"]
# a checkpoint at steps 2 and 4, ranked by the higher evaluation loss: the best is likely not the
# newest, so a load with best=True must read the one run.json names
BEST = [
    "trainer.args.save_steps=2",
    "trainer.args.eval_steps=2",
    "trainer.args.metric_for_best_model=eval_loss",
    "trainer.args.greater_is_better=true",
]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = write_project(tmp_path_factory.mktemp("api") / "plain")
    (root / "templates" / "configs" / "hf.yaml").write_text(HF_CONFIG)
    (root / "templates" / "configs" / "lora.yaml").write_text(LORA_CONFIG)
    return root


@pytest.fixture(scope="module")
def plain_run(project):
    """TinyLM (a module of the user's own) trained 4 steps here, keeping a moving average."""
    return forge.train("lm", project=project, overrides=EMA)


@pytest.fixture(scope="module")
def regress_run(project):
    """An nn.Sequential regressor on tuples, trained 4 steps here, without a moving average."""
    return forge.train("regress", project=project)


@pytest.fixture(scope="module")
def hf_runs(project):
    """A LlamaForCausalLM trained 4 steps, and a LoRA run on its checkpoint."""
    base = forge.train("hf", project=project)
    lora = forge.train(
        "lora",
        project=project,
        variables={"base_model": str(base.run_dir), "lora_target_modules": ["q_proj", "v_proj"]},
        overrides=EMA + BEST,
    )
    return base, lora


def evaluate_path(checkpoint, monkeypatch, ema: bool = False):
    """``forge evaluate``'s code path in this process: its metrics and the trainer it
    evaluated with (whose ``model`` holds the weights it evaluated)."""
    from forge.train.loop import BaseTrainer

    seen = []
    original = BaseTrainer.evaluate

    def evaluate(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BaseTrainer, "evaluate", evaluate)
    metrics = forge.CheckpointReader(checkpoint).evaluate("eval", ema=ema)
    monkeypatch.setattr(BaseTrainer, "evaluate", original)
    return metrics, seen[0]


def assert_same_logits(loaded, checkpoint, monkeypatch, ema: bool = False):
    """``loaded`` gives the logits of the model ``forge evaluate`` evaluates, bit for bit, and
    the same evaluation loss through the evaluate path."""
    metrics, trainer = evaluate_path(checkpoint, monkeypatch, ema=ema)
    dataset = trainer.eval_dataset
    batch = next(iter(trainer.build_eval_loader(dataset)))  # the batches evaluate runs
    batch = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        expected = trainer.model.eval()(**batch)["logits"]  # as evaluate runs it: no dropout
        got = loaded(**batch)["logits"]
    assert torch.equal(got, expected)
    trainer.model = loaded  # the evaluate path with the loaded model: the same loss, exactly
    assert trainer.evaluate(dataset)["eval_loss"] == metrics["eval_loss"]


# ---------------------------------------------------------------------------------------------
# render, build and errors


def test_import_forge_loads_no_torch_and_forge_train_is_both_package_and_function():
    code = (
        "import sys, forge\n"
        "assert 'torch' not in sys.modules, 'import forge loaded torch'\n"
        "import forge.train\n"
        "assert callable(forge.train) and 'torch' not in sys.modules\n"
        "cfg = forge.render(project='projects/tiny_lm')\n"
        "assert 'torch' not in sys.modules, 'forge.render loaded torch'\n"
        "print(cfg.text.splitlines()[0])\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("meta: ")


def test_render_from_python_is_what_forge_render_prints(project):
    overrides = ["trainer.args.learning_rate=0.5", "trainer.args.max_steps=7"]
    cfg = forge.render("lm", project=project, overrides=overrides)
    printed = run_forge(
        "render", "lm", "-p", str(project), "--set", overrides[0], "--set", overrides[1]
    )
    assert printed.returncode == 0, printed.stderr
    assert cfg.text.rstrip("\n") == printed.stdout.rstrip("\n")
    args = cfg.targets["trainer"].kwargs["args"].kwargs  # the object graph, not built
    assert (args["learning_rate"], args["max_steps"]) == (0.5, 7)


def test_build_with_variables_and_overrides(project):
    built = forge.build(
        "regress",
        ["train_dataset", "eval_dataset"],
        project=project,
        overrides=["eval_dataset.n=5"],
    )
    assert (len(built["train_dataset"]), len(built["eval_dataset"])) == (32, 5)
    model = forge.build("gru", "model", project=project)()  # a !partial: called to build
    assert isinstance(model, torch.nn.Module)


def test_a_config_mistake_raises_the_located_message_the_cli_prints(project):
    with pytest.raises(ConfigError) as caught:
        forge.build("lm", "model", project=project, overrides=["trainer.args.learning_rat=1"])
    printed = run_forge("build", "lm", "--target", "model", "-p", str(project), "--set",
                        "trainer.args.learning_rat=1")  # fmt: skip
    assert printed.returncode == 2
    assert printed.stderr.strip() == f"error: {caught.value}"
    assert "did you mean 'learning_rate'" in str(caught.value)


def test_a_template_error_names_its_file_and_line(project, tmp_path):
    broken = project / "templates" / "configs" / "broken.yaml"
    broken.write_text("-- extends 'configs/lm.yaml'\n-- block model\n{{ nope }}\n-- endblock\n")
    try:
        with pytest.raises(ConfigError) as caught:
            forge.render("broken", project=project)
        problem = caught.value.problems[0]
        assert problem.file.endswith("broken.yaml") and problem.line == 3
        assert "broken.yaml:3" in str(caught.value)
    finally:
        broken.unlink()


def test_train_refuses_several_processes_and_points_to_the_command_line(project):
    from forge.launch.errors import LaunchUsageError

    with pytest.raises(LaunchUsageError, match=r"forge train CONFIG --nproc N"):
        forge.train("lm", project=project, nproc=2)


# ---------------------------------------------------------------------------------------------
# train, resume and read


def test_train_in_process_makes_a_run_the_commands_know(plain_run, project):
    run_dir, output = plain_run.run_dir, plain_run.output
    assert output.global_step == 4 and output.training_loss > 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["overrides"] == EMA
    reader = forge.CheckpointReader(run_dir)
    assert reader.step == 4 and reader.run_dir == run_dir
    assert reader.metrics["eval_loss"] == pytest.approx(output.metrics["eval_loss"])
    assert reader.config.text == (run_dir / "config.yaml").read_text()
    assert reader.tokenizer is not None and reader.has_ema and not reader.is_adapter


def test_load_of_a_plain_module_gives_evaluates_logits(plain_run, monkeypatch):
    checkpoint = forge.CheckpointReader(plain_run.run_dir).path
    loaded = forge.load(plain_run.run_dir)
    assert not loaded.training and type(loaded).__name__ == "TinyLM"
    assert_same_logits(loaded, checkpoint, monkeypatch)


def test_load_with_ema_gives_evaluate_emas_logits(plain_run, monkeypatch):
    reader = forge.CheckpointReader(plain_run.run_dir)
    averaged = forge.load(plain_run.run_dir, ema=True)
    trained = reader.model()
    assert not torch.equal(averaged.head.weight, trained.head.weight)
    assert_same_logits(averaged, reader.path, monkeypatch, ema=True)
    state = reader.state_dict(ema=True)
    assert all(torch.equal(state[k], v) for k, v in averaged.state_dict().items())


def test_a_run_is_read_without_a_valid_checkpoint(plain_run, tmp_path):
    import shutil

    from forge.checkpoint.resolve import CheckpointNotFound

    run = forge.RunReader(plain_run.run_dir)
    summary = run.summary()
    assert (summary.config, summary.status, summary.step) == ("lm.yaml", "completed", 4)
    assert summary.checkpoints == 1 and summary.best is None and summary.stream == ""
    [entry] = run.checkpoints(verify=True)
    assert (entry.step, entry.kept, entry.valid) == (4, "last", True)
    assert entry.size == sum(f.stat().st_size for f in entry.path.iterdir())
    assert forge.CheckpointReader(plain_run.run_dir).run.run_dir == run.run_dir
    # a copy whose only checkpoint is damaged: no checkpoint to open, the run still read
    damaged = tmp_path / "output" / "lm" / "run_001"
    shutil.copytree(plain_run.run_dir, damaged)
    (damaged / "checkpoints" / entry.path.name / "trainer.pt").write_bytes(b"")
    with pytest.raises(CheckpointNotFound):
        forge.CheckpointReader(damaged)
    [broken] = forge.RunReader(damaged).checkpoints()
    assert not broken.valid and "trainer.pt" in broken.problems[0]
    assert forge.RunReader(damaged).summary().step == 4


def test_load_on_a_device_in_a_dtype(plain_run):
    model = forge.load(plain_run.run_dir, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="no torch dtype"):
        forge.load(plain_run.run_dir, dtype="bf17")


def test_load_refuses_what_the_checkpoint_does_not_hold(plain_run, regress_run, tmp_path):
    from forge.checkpoint.resolve import CheckpointNotFound, CheckpointUsageError

    with pytest.raises(CheckpointUsageError, match="holds no moving average"):
        forge.load(regress_run.run_dir, ema=True)
    with pytest.raises(CheckpointUsageError, match="holds no adapter"):
        forge.load(plain_run.run_dir, merge_lora=True)
    with pytest.raises(CheckpointNotFound, match="no such checkpoint"):
        forge.load(tmp_path / "nothing")


@pytest.mark.slow  # two runs trained here (~10 s); the plain module's test is the fast one
def test_load_of_a_hugging_face_model_run_gives_evaluates_logits(hf_runs, monkeypatch):
    base, _ = hf_runs
    reader = forge.CheckpointReader(base.run_dir)
    loaded = reader.model()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert_same_logits(loaded, reader.path, monkeypatch)


@pytest.mark.slow  # two runs trained here (~10 s); the plain module's test is the fast one
def test_load_of_a_lora_run_merged_and_not(hf_runs, monkeypatch, tmp_path):
    from forge.read.reader import export_model
    from forge.wrappers import is_peft_model

    _, lora = hf_runs
    reader = forge.CheckpointReader(lora.run_dir, best=True)
    assert reader.path.resolve() == (reader.run_dir / reader.record["best"]["checkpoint"]).resolve()
    assert reader.is_adapter and reader.has_ema
    adapter = forge.load(lora.run_dir, best=True)
    assert is_peft_model(adapter) and not adapter.training
    assert_same_logits(adapter, reader.path, monkeypatch)
    averaged = forge.load(lora.run_dir, best=True, ema=True)
    assert_same_logits(averaged, reader.path, monkeypatch, ema=True)
    merged = forge.load(lora.run_dir, best=True, merge_lora=True)
    assert not is_peft_model(merged) and type(merged).__name__ == "LlamaForCausalLM"
    # merging changes the arithmetic (W + BA, not Wx + BAx): close to the adapter's logits,
    # and bit for bit the weights `forge export --merge-lora` writes
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapter(ids).logits, atol=1e-5)
    export_model(reader.path, tmp_path / "merged", merge_lora=True)
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "merged" / "model.safetensors")
    state = reader.state_dict(merge_lora=True)
    assert all(torch.equal(state[name], tensor) for name, tensor in exported.items())
    from transformers import AutoModelForCausalLM

    from_export = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():  # what a user of the export gets: the same logits, bit for bit
        assert torch.equal(merged(ids).logits, from_export(ids).logits)
    assert set(reader.state_dict()) == set(load_file(reader.path / "adapter_model.safetensors"))


def test_resume_in_process_continues_the_run(project, regress_run):
    first = regress_run
    done = forge.resume(first.run_dir, project=project)
    assert done.output is None and "is complete" in done.note
    more = forge.resume(first.run_dir, project=project, overrides=["trainer.args.max_steps=6"])
    assert more.run_dir == first.run_dir and more.output.global_step == 6
    record = json.loads((first.run_dir / "run.json").read_text())
    assert record["status"] == "completed" and len(record["resumes"]) == 1
    assert forge.CheckpointReader(first.run_dir).step == 6


# ---------------------------------------------------------------------------------------------
# several processes (torchrun, 2 processes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        ("pipeline", EMA),
        ("hf", ["trainer.args.fsdp=full_shard"]),
    ],
    ids=["pipeline-ema", "fsdp"],
)
def test_load_of_a_two_process_runs_best_checkpoint_gives_evaluates_logits(
    project, config, overrides, monkeypatch
):
    sets = [word for override in overrides + BEST for word in ("--set", override)]
    result = run_forge("train", config, "-p", str(project), "--nproc", "2", *sets, timeout=600)
    assert result.returncode == 0, f"forge train {config} --nproc 2 failed:\n{result.stderr}"
    run_dir = result.stdout.strip().splitlines()[-1]
    reader = forge.CheckpointReader(run_dir, best=True)
    assert reader.path.resolve() == (reader.run_dir / reader.record["best"]["checkpoint"]).resolve()
    assert_same_logits(forge.load(run_dir, best=True), reader.path, monkeypatch)
    # the command itself prints the metrics that code path gave
    printed = run_forge("evaluate", run_dir, "--best", "--json", timeout=300)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["eval_loss"] == reader.evaluate()["eval_loss"]
    assert reader.has_ema == (EMA[0] in overrides)
    if reader.has_ema:  # the pipeline run: its moving average, put back whole from its stages
        averaged = forge.load(run_dir, best=True, ema=True)
        assert_same_logits(averaged, reader.path, monkeypatch, ema=True)


# ---------------------------------------------------------------------------------------------
# the documentation's example


def test_the_python_api_pages_example_runs(tmp_path, monkeypatch, capsys):
    from forge.cli.new import new_project
    from tests import docs

    new_project("demo_cls", tmp_path, "classifier")
    monkeypatch.chdir(tmp_path)
    example = docs.block_from(
        "python", "# a notebook beside the project demo_cls (forge new demo_cls --from classifier)"
    )
    exec(compile(example, "docs/python-api.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("meta:")
    assert printed[1].endswith("demo_cls/output/train/run_001 40 " + printed[1].split()[-1])
    assert printed[-1].endswith("of 8 right")
    run_dir = tmp_path / "demo_cls/output/train/run_001"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["step"] == 40
    best = forge.CheckpointReader(run_dir, best=True)  # the one run.json records
    assert best.metrics[record["best"]["metric"]] == record["best"]["value"]
