"""The datasets/local_files.yaml template: HF `datasets` from local json / csv / parquet / text
files, tokenized by a cached `map`; and tokenize_dataset's checks."""

from __future__ import annotations

import json
import logging

import pytest

from forge.config import load_config, load_project
from forge.launch.worker import build_variables

datasets = pytest.importorskip("datasets")

ROWS = [{"text": f"row {i} says hello", "label": i % 2} for i in range(6)]

CONFIG = """\
-- extends 'base.yaml'
-- set data_format = "{fmt}"
-- set train_files = {train}
-- set eval_files = "eval.{ext}"
-- set max_length = 4
-- block tokenizer
tokenizer: &tokenizer !singleton:forge.data:load_or_train_tokenizer
    cache_dir: {cache}
    vocab_size: 512
    max_files: 30
-- endblock
-- block datasets
    -- include 'datasets/local_files.yaml'
-- endblock
"""


def write(path, fmt):
    if fmt == "json":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "csv":
        path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in ROWS))
    elif fmt == "text":
        path.write_text("".join(r["text"] + "\n" for r in ROWS))
    else:
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))


@pytest.mark.parametrize(
    ("fmt", "ext"), [("json", "jsonl"), ("csv", "csv"), ("parquet", "parquet"), ("text", "txt")]
)
def test_local_files_load_tokenize_and_cache(tmp_path, tokenizer_cache, fmt, ext, caplog):
    (tmp_path / "templates" / "configs").mkdir(parents=True)
    (tmp_path / "meta.yaml").write_text("name: files\n")
    (tmp_path / "data").mkdir()
    for name in (f"data/a.{ext}", f"data/b.{ext}", f"eval.{ext}"):
        write(tmp_path / name, fmt)
    train = json.dumps([f"data/a.{ext}", f"data/b.{ext}"])  # a list, relative to the project
    config = CONFIG.format(fmt=fmt, train=train, ext=ext, cache=json.dumps(str(tokenizer_cache)))
    (tmp_path / "templates" / "configs" / "c.yaml").write_text(config)
    project = load_project(tmp_path)
    cfg = load_config(project, "c")
    assert cfg.check() == []
    variables = build_variables(tmp_path / "run", project, "c")
    built = cfg.build(["train_dataset", "eval_dataset"], variables)
    train_set, eval_set = built["train_dataset"], built["eval_dataset"]
    assert len(train_set) == 2 * len(ROWS) and len(eval_set) == len(ROWS)
    assert "input_ids" in train_set.column_names and "text" in train_set.column_names
    assert all(len(ids) <= 4 for ids in train_set["input_ids"])  # max_length
    cache = project.output_dir / "hf_datasets"
    assert all(str(f["filename"]).startswith(str(cache)) for f in train_set.cache_files)
    with caplog.at_level(logging.INFO):
        again = load_config(project, "c").build("train_dataset", variables)
    assert again.cache_files == train_set.cache_files  # the map result was read back


def test_tokenize_dataset_names_the_columns_there_are(small_tokenizer):
    from forge.data.hf_datasets import tokenize_dataset

    data = datasets.Dataset.from_list(ROWS)
    with pytest.raises(ValueError, match="text_column 'review' is not a column .* text, label"):
        tokenize_dataset(data, small_tokenizer, text_column="review")
    with pytest.raises(TypeError, match="needs a datasets.Dataset"):
        tokenize_dataset({"train": data}, small_tokenizer)
