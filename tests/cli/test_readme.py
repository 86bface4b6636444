"""The examples of the README and of docs/*.md stay true: each is found in whichever page shows
it (tests/docs.py) and run, and what forge prints is compared with what the page shows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests import docs
from tests.helpers import REPO, run_forge


def readme_block(marker: str) -> str:
    return docs.block("yaml", marker)


def test_readme_broken_config_reports_its_three_problems(tmp_path):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: bad\n")
    broken = readme_block("# templates/configs/broken.yaml")
    (tmp_path / "templates" / "configs" / "broken.yaml").write_text(broken)
    result = run_forge("train", "broken", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    shown = docs.output("forge train broken --dry-run")
    for line in shown.splitlines():
        if line.startswith("templates/"):
            located = line.split(" (valid:")[0]
            assert located in result.stderr, located


def test_readme_tiny_lm_config_is_the_shipped_one():
    shipped = (REPO / "projects/tiny_lm/templates/configs/train.yaml").read_text().rstrip()
    assert docs.find(re.escape(shipped), "the shipped config")


def readme_commands(first: str) -> list[list[str]]:
    """The `forge ...` lines of the bash block whose first line starts with ``first``."""
    return docs.commands(first)


def test_readme_new_project_example_runs(tmp_path):
    commands = readme_commands("forge new demo_cls")
    assert len(commands) == 4
    for command in commands:
        result = run_forge(*command, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
    assert (tmp_path / "demo_cls" / "output" / "wide" / "run_001" / "checkpoints").is_dir()
    loading = docs.block_from("python", "import sys")
    loaded = subprocess.run(
        [sys.executable, "-c", loading + "\nprint(sorted(model.state_dict()))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "net.0.weight" in loaded.stdout


@pytest.mark.slow
def test_readme_optimizer_and_scheduler_partials_train(tmp_path):
    assert run_forge("new", "demo_cls", "--from", "classifier", cwd=tmp_path).returncode == 0
    configs = tmp_path / "demo_cls" / "templates" / "configs"
    (configs / "sgd.yaml").write_text(readme_block("# templates/configs/sgd.yaml"))
    result = run_forge("train", "sgd", "-p", "demo_cls", "-D", "max_steps=40", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "demo_cls" / "output" / "sgd" / "run_001"
    logs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [m["learning_rate"] for m in logs if "learning_rate" in m]
    losses = [m["loss"] for m in logs if "loss" in m]
    assert rates == sorted(rates, reverse=True) and rates[0] < 0.1  # cosine, from 0.1 down
    assert losses[-1] < 0.5 * losses[0]
    bad = readme_block("# templates/configs/sgd.yaml").replace(
        "eta_min:", "T_max: 100\n    eta_min:"
    )
    (configs / "bad.yaml").write_text(bad)
    result = run_forge("train", "bad", "-p", "demo_cls", "-D", "max_steps=4", cwd=tmp_path)
    assert result.returncode == 2
    assert "multiple values for argument 'T_max'" in result.stderr
    assert "leave out 'T_max': the trainer passes num_training_steps" in result.stderr
    assert not (tmp_path / "demo_cls" / "output" / "bad").exists()


def test_readme_contract_error_is_what_forge_prints(tmp_path):
    assert run_forge("new", "demo_cls", "--from", "classifier", cwd=tmp_path).returncode == 0
    data = tmp_path / "demo_cls" / "data.py"
    data.write_text(data.read_text().replace('{"features":', '{"inputs":'))
    result = run_forge("train", "-p", "demo_cls", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    shown = docs.output("forge train -p demo_cls --dry-run").removesuffix("\n")
    assert result.stderr.strip() == shown


def test_readme_text_cls_config_is_the_shipped_one():
    shipped = (REPO / "projects/text_cls/templates/configs/train.yaml").read_text().rstrip()
    assert docs.find(re.escape(shipped), "the shipped config")


def test_the_local_files_dataset_example_reads_the_files_it_names(tmp_path):
    """docs/models-and-data.md's config on JSON Lines files of one's own, rendered in a copy of
    text_cls (building it, which reads the files with `datasets`, takes a minute)."""
    project = tmp_path / "text_cls"
    shutil.copytree(
        REPO / "projects" / "text_cls", project, ignore=shutil.ignore_patterns("output")
    )
    config = readme_block("# templates/configs/reviews.yaml")
    (project / "templates" / "configs" / "reviews.yaml").write_text(config)
    result = run_forge("render", "reviews", "-p", str(project), "--resolved")
    assert result.returncode == 0, result.stderr
    files = result.stdout.split("data_files: !dict", 1)[1].split("cache_dir:", 1)[0]
    assert f'- "{project / "data/train.jsonl"}"' in files
    assert f'- "{project / "data/eval.jsonl"}"' in files
    assert "tokenize_dataset" in result.stdout


@pytest.mark.slow
def test_readme_text_cls_commands_run(tmp_path):
    """Train text_cls as its page does, then evaluate, predict and generate from it."""
    pytest.importorskip("datasets")
    project = tmp_path / "projects" / "text_cls"
    shutil.copytree(
        REPO / "projects" / "text_cls", project, ignore=shutil.ignore_patterns("output")
    )
    (tmp_path / "reviews.jsonl").write_text('{"text": "the acting was superb"}\n')
    train, evaluate, predict, generate = readme_commands("forge train -p projects/text_cls")
    assert run_forge(*train, cwd=tmp_path).returncode == 0
    result = run_forge(*evaluate, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    accuracy = float(result.stdout.split("eval_accuracy")[1].split()[0])
    assert accuracy > 0.85  # its page says it climbs to about 0.95
    assert run_forge(*predict, cwd=tmp_path).returncode == 0
    assert '"prediction": "positive"' in (tmp_path / "labelled.jsonl").read_text()
    refused = run_forge(*generate, cwd=tmp_path)
    assert refused.returncode == 2
    assert "holds a BertForSequenceClassification" in refused.stderr


def test_readme_template_table_lists_every_library_template():
    from forge.config import LIBRARY_DIR

    page = docs.find(r"\| library template \| what it holds \|\n", "the library templates table")
    table = page.string[page.end() :].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    shipped = {p.relative_to(LIBRARY_DIR).as_posix() for p in LIBRARY_DIR.rglob("*.yaml")}
    assert listed == shipped


def readme_python(marker: str) -> str:
    return docs.block("python", marker)


@pytest.mark.slow  # fast representatives: tests/train/test_adapters.py, test_loss_func.py
def test_readme_plain_pytorch_model_and_data_train_with_the_adapters(tmp_path):
    assert run_forge("new", "plain", "--from", "blank", cwd=tmp_path).returncode == 0
    project = tmp_path / "plain"
    (project / "model.py").write_text(readme_python("# model.py"))
    (project / "data.py").write_text(readme_python("# data.py"))
    for name in ("plain", "logits"):
        config = readme_block(f"# templates/configs/{name}.yaml")
        (project / "templates" / "configs" / f"{name}.yaml").write_text(config)
    for name in ("plain", "logits"):
        steps = ["-D", "max_steps=10", "-D", "eval_steps=10", "-D", "save_steps=10"]
        result = run_forge("train", name, "-p", "plain", *steps, cwd=tmp_path)
        assert result.returncode == 0, (name, result.stderr)
        assert "eval at step 10 | eval_loss " in result.stderr, name


def lightning_project(root) -> str:
    """docs/models-and-data.md's LightningModule project, made as the page says: `forge new lit
    --from blank`, its data.py (the plain PyTorch example's), lit_model.py and the config;
    returns the project's name."""
    assert run_forge("new", "lit", "--from", "blank", cwd=root).returncode == 0
    project = root / "lit"
    (project / "data.py").write_text(readme_python("# data.py"))
    (project / "lit_model.py").write_text(readme_python("# lit_model.py"))
    config = readme_block("# templates/configs/lightning.yaml")
    (project / "templates" / "configs" / "lightning.yaml").write_text(config)
    return "lit"


def test_docs_lightning_config_checks(tmp_path):
    """The config renders and passes the check before training (the batch reaches the
    adapter whole); the fast representative of the training below."""
    pytest.importorskip("lightning", reason="needs Lightning: pip install 'forge[lightning]'")
    name = lightning_project(tmp_path)
    result = run_forge("train", "lightning", "-p", name, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config lightning.yaml renders and checks"), result.stdout


def test_docs_lightning_refusal_is_what_the_adapter_says(tmp_path):
    """The refusal the page shows is the adapter's, for the page's LitClassifier with an
    on_train_epoch_end."""
    pytest.importorskip("lightning", reason="needs Lightning: pip install 'forge[lightning]'")
    from forge.train import LightningAdapter
    from forge.train.lightning import LightningAdapterError

    shown = docs.find(r"```\n(LightningAdapter does not run [^\n]*)\n```", "the refusal").group(1)
    namespace: dict = {}
    exec(compile(readme_python("# lit_model.py"), "lit_model.py", "exec"), namespace)
    hooked = type(
        "LitClassifier",
        (namespace["LitClassifier"],),
        {"on_train_epoch_end": lambda self: None},
    )
    with pytest.raises(LightningAdapterError) as error:
        LightningAdapter(hooked())
    assert str(error.value) == shown


@pytest.mark.slow  # fast representatives: the two tests above, tests/train/test_lightning_*.py
def test_docs_lightning_module_trains_through_the_adapter(tmp_path):
    pytest.importorskip("lightning", reason="needs Lightning: pip install 'forge[lightning]'")
    name = lightning_project(tmp_path)
    (one_process, *_) = docs.commands("forge train lightning")
    result = run_forge(*one_process, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # 4 batches an epoch: the epoch's mean at its end, validation_step's val_acc as eval_val_acc
    assert re.search(
        r"step 4/8 \| loss [\d.]+ \| train_loss_step [\d.]+ \| train_loss_epoch", result.stderr
    ), result.stderr
    assert "eval at step 4 | eval_val_acc " in result.stderr
    assert (
        "optimizer and learning-rate schedule from LitClassifier.configure_optimizers"
        in result.stderr
    )
    run = json.loads(
        (tmp_path / name / "output" / "lightning" / "run_001" / "run.json").read_text()
    )
    assert run["status"] == "completed"


@pytest.mark.slow
def test_the_stream_example_trains_from_its_iterable_dataset(tmp_path):
    """docs/models-and-data.md's user stream in a classifier scaffold: it passes the sanity pass
    (which loads a batch from the stream); without max_steps it is refused there, located."""
    assert run_forge("new", "itds", "--from", "classifier", cwd=tmp_path).returncode == 0
    project = tmp_path / "itds"
    with open(project / "data.py", "a") as file:
        file.write("\n\n" + docs.block("python", "# data.py (added)"))
    config = readme_block("# templates/configs/stream.yaml")
    (project / "templates" / "configs" / "stream.yaml").write_text(config)
    result = run_forge("train", "stream", "-p", str(project), "--dry-run")
    assert result.returncode == 0, result.stderr
    refused = run_forge("train", "stream", "-p", str(project), "--dry-run", "-D", "max_steps=-1")
    assert refused.returncode == 2
    assert "train.yaml:" in refused.stderr and "max_steps must be set" in refused.stderr
    assert "Traceback" not in refused.stderr
