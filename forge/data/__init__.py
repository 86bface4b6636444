"""Corpora, tokenizers, datasets, collators and resumable sharded loaders."""

from forge.data.collator import CausalLMCollator, TupleCollator
from forge.data.corpus import read_text_files, stdlib_dir, stdlib_source_files
from forge.data.datasets import PackedTextDataset
from forge.data.loader import (
    ResumableDataLoader,
    ResumableDistributedSampler,
    build_dataloader,
    loader_epoch_length,
)
from forge.data.tokenizer import load_or_train_tokenizer

__all__ = [
    "CausalLMCollator",
    "PackedTextDataset",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "TupleCollator",
    "build_dataloader",
    "load_or_train_tokenizer",
    "loader_epoch_length",
    "read_text_files",
    "stdlib_dir",
    "stdlib_source_files",
]
