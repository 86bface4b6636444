"""The text_cls project end to end, through the real entry point: an HF-named classifier config
trains, picks its best checkpoint by accuracy (RUN/best), and `forge evaluate` / `forge
predict` use it; `forge generate` refuses it. Bad HF argument values fail the config check."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.helpers import REPO, run_forge

TEXT_CLS = REPO / "projects" / "text_cls"
SMALL = [
    "-D", "max_steps=12", "-D", "eval_steps=4", "-D", "save_steps=4", "-D", "logging_steps=4",
    "-D", "num_train=256", "-D", "num_eval=64", "-D", "learning_rate=3e-3",
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("datasets")
    project = tmp_path_factory.mktemp("p") / "text_cls"
    shutil.copytree(TEXT_CLS, project, ignore=shutil.ignore_patterns("output", "__pycache__"))
    result = run_forge("train", "-p", str(project), *SMALL)
    assert result.returncode == 0, result.stderr
    run_dir = project / "output" / "train" / "run_001"
    return project, run_dir, result


def test_training_logs_accuracy_and_links_the_best_checkpoint(trained):
    _, run_dir, result = trained
    assert "dropping text from the train dataset" in result.stderr  # remove_unused_columns
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "eval_accuracy" in line
    ]
    assert [e["step"] for e in evals] == [4, 8, 12]
    assert all("eval_perplexity" not in e for e in evals)
    record = json.loads((run_dir / "run.json").read_text())
    best = max(evals, key=lambda e: (e["eval_accuracy"], -e["step"]))
    assert record["best"]["metric"] == "eval_accuracy"
    assert record["best"]["value"] == best["eval_accuracy"]
    link = run_dir / "best"
    assert link.is_symlink()
    assert link.resolve() == (run_dir / record["best"]["checkpoint"]).resolve()
    assert link.resolve().name == f"checkpoint-{best['step']:06d}"


def test_evaluate_best_prints_the_best_checkpoint_metrics(trained):
    _, run_dir, _ = trained
    record = json.loads((run_dir / "run.json").read_text())
    result = run_forge("evaluate", str(run_dir), "--best", "--json")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert metrics["checkpoint"] == str((run_dir / "best").resolve())
    assert metrics["eval_accuracy"] == pytest.approx(record["best"]["value"])
    by_link = run_forge("evaluate", str(run_dir / "best"))
    assert by_link.returncode == 0, by_link.stderr
    assert by_link.stdout.splitlines()[0].split() == [
        "eval_accuracy",
        f"{metrics['eval_accuracy']:.6g}",
    ]
    assert not (run_dir / "metrics.jsonl").read_text().count('"step": 0')  # the run is untouched
    train_split = run_forge("evaluate", str(run_dir / "best"), "--split", "train", "--json")
    assert "train_accuracy" in json.loads(train_split.stdout)
    missing = run_forge("evaluate", str(run_dir), "--split", "test")
    assert missing.returncode == 2
    assert "no 'test' split (no test_dataset target); splits: eval, train" in missing.stderr


def test_predict_writes_class_labels(trained, tmp_path):
    _, run_dir, _ = trained
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(
        json.dumps({"text": "the movie was great and superb", "id": 1})
        + "\n"
        + json.dumps("the plot felt dull and boring and awful")
        + "\n"
    )
    output = tmp_path / "out.jsonl"
    result = run_forge(
        "predict", str(run_dir), "--best", "--input", str(inputs), "--output", str(output)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(output)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r.get("id") for r in rows] == [1, None]
    assert all(r["prediction"] in ("positive", "negative") and 0.5 <= r["score"] <= 1 for r in rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"review": "good"}\n')
    refused = run_forge("predict", str(run_dir), "--input", str(bad), "--output", str(output))
    assert refused.returncode == 2
    assert f"{bad}:1: needs a string field 'text' (found review)" in refused.stderr


def test_generate_refuses_a_classifier(trained):
    _, run_dir, _ = trained
    result = run_forge("generate", str(run_dir), "--prompt", "the")
    assert result.returncode == 2
    assert "holds a BertForSequenceClassification, which does not generate text" in result.stderr
    assert "forge predict" in result.stderr and "Traceback" not in result.stderr


BAD_VALUES = {
    "trainer.args.eval_strategy=epoch": "save_strategy must equal eval_strategy",
    "trainer.args.lr_scheduler_type=cosine_with_min_lr": "needs lr_scheduler_kwargs with min_lr",
    "trainer.args.report_to=comet_ml": "an HF integration forge has no callback for",
    "trainer.args.optim=lion_8bit": "optim 'lion_8bit' is not one forge builds",
}


def test_bad_hf_values_fail_the_dry_run_each_located():
    sets = [word for setting in BAD_VALUES for word in ("--set", setting)]
    result = run_forge("train", "-p", str(TEXT_CLS), "--dry-run", *sets)
    assert result.returncode == 2, result.stdout
    assert f"{len(BAD_VALUES)} problems" in result.stderr  # all at once
    lines = result.stderr.splitlines()
    for fragment in BAD_VALUES.values():
        (at,) = [i for i, line in enumerate(lines) if fragment in line]
        # located: the template line of the key it names, or the --set that gave the value
        assert re.match(r"\S+\.yaml:\d+: ", lines[at]) or lines[at + 1].startswith("    --set ")


@pytest.mark.slow
def test_hf_values_the_check_accepts(tmp_path):
    result = run_forge(
        "train", "-p", str(TEXT_CLS), "--dry-run",
        "--set", "trainer.args.save_strategy=best",
        "--set", "trainer.args.lr_scheduler_type=cosine_with_restarts",
        "--set", "trainer.args.logging_strategy=epoch",
        "--set", "trainer.args.optim=sgd",
        "--set", "trainer.args.optim_args=momentum=0.9",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_a_value_problem_is_located_at_its_template_line():
    result = run_forge("train", "-p", str(REPO / "projects" / "tiny_lm"), "-D", "save_steps=0")
    assert result.returncode == 2
    assert "templates/configs/train.yaml:" in result.stderr
    assert "trainer.args.save_steps must be a positive integer" in result.stderr
    assert "run_" not in result.stdout  # refused before a run directory was made
