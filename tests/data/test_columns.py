"""remove_unused_columns: the columns the model's forward does not take never reach it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from forge.data.columns import RemoveColumnsCollator, remove_unused_columns, signature_columns


class Net(nn.Module):
    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"loss": input_ids.float().mean()}


def test_signature_columns_are_forward_parameters_and_label_names():
    columns = signature_columns(Net(), ["labels", "score"])
    assert columns[:3] == ["input_ids", "attention_mask", "labels"]
    assert {"label", "label_ids", "score"} <= set(columns)


def test_a_plain_dataset_loses_the_keys_in_the_collator_with_one_log_line(caplog):
    items = [{"input_ids": torch.tensor([1, 2]), "text": "a", "id": 3}] * 2
    _, collator = remove_unused_columns(items, None, Net(), ["labels"], "train")
    with caplog.at_level(logging.INFO, logger="forge.data.columns"):
        batch = collator(items)
        collator(items)
    assert set(batch) == {"input_ids"}
    assert caplog.messages == [
        "remove_unused_columns: dropping id, text from the train items: Net.forward does not "
        "take them"
    ]


def test_items_with_no_model_input_are_a_clear_error():
    collator = RemoveColumnsCollator(None, signature_columns(Net(), ["labels"]), model_name="Net")
    with pytest.raises(ValueError, match="no key of the dataset items is an argument of Net"):
        collator([{"text": "a"}])


def test_a_datasets_dataset_loses_the_columns_once():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list([{"input_ids": [1, 2], "text": "a", "label": 1}])
    kept, collator = remove_unused_columns(data, None, Net(), ["labels"], "eval")
    assert kept.column_names == ["input_ids", "label"] and collator is None
    with pytest.raises(ValueError, match="remove_unused_columns: false"):
        remove_unused_columns(data.select_columns(["text"]), None, Net(), ["labels"])


def test_a_quiet_check_drops_the_same_columns_without_logging(caplog):
    # the pre-run check is quiet (the trainer logs the drop); it must still drop the columns,
    # or a text column reaches the collator and the check refuses a config that trains
    datasets = pytest.importorskip("datasets")
    from forge.data.columns import ModelInputs, keep_model_inputs

    data = datasets.Dataset.from_list([{"input_ids": [1, 2], "text": "a", "label": 1}])
    inputs = ModelInputs.of(Net(), ["labels"])
    with caplog.at_level(logging.INFO, logger="forge.data.columns"):
        kept, _ = keep_model_inputs(data, None, inputs, quiet=True)
    assert kept.column_names == ["input_ids", "label"]
    assert caplog.messages == []
