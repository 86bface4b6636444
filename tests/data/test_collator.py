from __future__ import annotations

import pytest
import torch

from forge.data import CausalLMCollator


def test_pads_on_the_right_and_masks_labels_by_position() -> None:
    eos = 0  # pad equals eos: a real eos inside an item must stay a label
    collate = CausalLMCollator(pad_token_id=eos)
    batch = collate([{"input_ids": torch.tensor([5, 0, 7])}, {"input_ids": [9]}])
    assert batch["input_ids"].tolist() == [[5, 0, 7], [9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 0, 7], [9, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_equal_lengths_need_no_padding() -> None:
    items = [{"input_ids": torch.arange(4) + 10 * i} for i in range(3)]
    batch = CausalLMCollator(pad_token_id=1, label_pad_id=-1)(items)
    assert torch.equal(batch["input_ids"], torch.stack([item["input_ids"] for item in items]))
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert bool(batch["attention_mask"].all())


def test_keeps_given_labels() -> None:
    batch = CausalLMCollator(pad_token_id=3, label_pad_id=-7)(
        [{"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [4, 5, 6], "labels": [4, 5, 6]}]
    )
    assert batch["labels"].tolist() == [[-100, 2, -7], [4, 5, 6]]
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_errors() -> None:
    with pytest.raises(ValueError, match="pad_token_id"):
        CausalLMCollator(pad_token_id=-1)
    with pytest.raises(ValueError, match="empty batch"):
        CausalLMCollator()([])
    with pytest.raises(ValueError, match="labels length"):
        CausalLMCollator()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="1-d"):
        CausalLMCollator()([{"input_ids": [[1, 2]]}])
