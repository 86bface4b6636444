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


def test_tuple_collator_names_the_parts_of_tuple_items():
    from forge.data import TupleCollator

    items = [
        (torch.tensor([1.0, 2.0]), torch.tensor(0)),
        (torch.tensor([3.0, 4.0]), torch.tensor(1)),
    ]
    batch = TupleCollator(["x", "labels"])(items)
    assert set(batch) == {"x", "labels"}
    assert torch.equal(batch["x"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(batch["labels"], torch.tensor([0, 1]))
    # dict items pass as they are
    assert set(TupleCollator(["x", "labels"])([{"a": torch.tensor(1)}])) == {"a"}


def test_tuple_collator_names_the_tuple_a_collator_returns():
    from forge.data import TupleCollator

    def stack(items):
        return torch.stack([i for i, _ in items]), torch.tensor([t for _, t in items])

    collator = TupleCollator(["inputs", "targets"], collator=stack)
    batch = collator([(torch.zeros(2), 1), (torch.ones(2), 0)])
    assert torch.equal(batch["targets"], torch.tensor([1, 0]))
    assert batch["inputs"].shape == (2, 2)


def test_tuple_collator_says_when_names_and_parts_do_not_match():
    from forge.data import TupleCollator

    with pytest.raises(ValueError, match=r"names 2 parts \(x, labels\) but an item has 3"):
        TupleCollator(["x", "labels"])([(torch.zeros(1), torch.zeros(1), torch.zeros(1))])
    with pytest.raises(ValueError, match="one per part of an item"):
        TupleCollator([])
    with pytest.raises(ValueError, match="repeat a key"):
        TupleCollator(["x", "x"])
