from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from forge.data import PackedTextDataset, stdlib_source_files
from forge.data import datasets as datasets_module

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())\n" * 3,
    "",
    "class Point:\n    x: int = 0\n    y: int = 0\n" * 2,
]


def _stream(tokenizer, texts: list[str]) -> list[int]:
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return stream


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_blocks_are_contiguous_slices_of_the_token_stream(small_tokenizer, block_size: int) -> None:
    dataset = PackedTextDataset(small_tokenizer, texts=TEXTS, block_size=block_size)
    stream = _stream(small_tokenizer, TEXTS)
    assert dataset.num_tokens == len(stream)
    assert len(dataset) == len(stream) // block_size
    for i in range(len(dataset)):
        item = dataset[i]["input_ids"]
        assert item.dtype == torch.int64 and item.shape == (block_size,)
        assert item.tolist() == stream[i * block_size : (i + 1) * block_size]
    assert repr(dataset) == (
        f"PackedTextDataset(blocks={len(dataset)}, block_size={block_size}, "
        f"num_tokens={len(stream)})"
    )
    assert dataset[-1]["input_ids"].tolist() == dataset[len(dataset) - 1]["input_ids"].tolist()
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_stdlib_split_is_deterministic_and_separated_by_eos(small_tokenizer) -> None:
    first = PackedTextDataset(small_tokenizer, split="eval", block_size=64, max_files=5)
    second = PackedTextDataset(small_tokenizer, split="eval", block_size=64, max_files=5)
    assert len(first) == len(second) > 0
    assert np.array_equal(first.tokens, second.tokens)
    eos_count = int((first.tokens == small_tokenizer.eos_token_id).sum())
    assert eos_count == 5 and first.tokens[-1] == small_tokenizer.eos_token_id


def test_files_match_the_same_texts(small_tokenizer, tmp_path: Path) -> None:
    paths = []
    for i, text in enumerate(TEXTS):
        paths.append(tmp_path / f"doc{i}.py")
        paths[-1].write_text(text)
    from_files = PackedTextDataset(small_tokenizer, files=paths, block_size=8)
    from_texts = PackedTextDataset(small_tokenizer, texts=TEXTS, block_size=8)
    assert np.array_equal(from_files.tokens, from_texts.tokens)
    first_two = PackedTextDataset(small_tokenizer, files=paths, max_files=2, block_size=8)
    assert first_two.num_tokens == len(_stream(small_tokenizer, TEXTS[:2]))


def test_token_cache_is_reused(
    small_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = stdlib_source_files("eval", max_files=3)
    built = PackedTextDataset(small_tokenizer, files=files, block_size=32, cache_dir=tmp_path)
    cached = sorted(tmp_path.glob("*.npy"))
    assert len(cached) == 1 and not list(tmp_path.glob(".*"))  # no staging files left

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr(datasets_module, "tokenize_and_pack", refuse)
    again = PackedTextDataset(small_tokenizer, files=files, block_size=16, cache_dir=tmp_path)
    assert np.array_equal(again.tokens, built.tokens) and len(again) == 2 * len(built)
    assert sorted(tmp_path.glob("*.npy")) == cached  # block size does not change the stream
    with pytest.raises(AssertionError, match="tokenized again"):
        PackedTextDataset(small_tokenizer, files=files[:2], block_size=16, cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"texts": "just one string"}, "texts"),
        ({"texts": ["a"], "files": ["b"]}, "either texts or files"),
        ({"texts": ["a b"], "block_size": 1000}, "fewer than block_size"),
        ({"files": ["/no/such/file.py"]}, "files"),
        ({"split": "dev"}, "split"),
    ],
)
def test_bad_arguments_are_named(small_tokenizer, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackedTextDataset(small_tokenizer, **kwargs)
