"""Corpora, tokenizers, datasets, collators and resumable sharded loaders."""

from forge.data.collator import CausalLMCollator, TupleCollator
from forge.data.corpus import read_text_files, stdlib_dir, stdlib_source_files
from forge.data.datasets import PackedTextDataset
from forge.data.loader import ResumableDataLoader, build_dataloader, loader_epoch_length
from forge.data.sampler import ResumableDistributedSampler
from forge.data.streams import ShardReader, build_stream_loader
from forge.data.tokenizer import load_or_train_tokenizer
from forge.data.trainer_loaders import (
    StridedSampler,
    build_eval_loader,
    build_train_loader,
    worker_settings,
)

__all__ = [
    "CausalLMCollator",
    "PackedTextDataset",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "ShardReader",
    "StridedSampler",
    "TupleCollator",
    "build_dataloader",
    "build_eval_loader",
    "build_stream_loader",
    "build_train_loader",
    "load_or_train_tokenizer",
    "loader_epoch_length",
    "read_text_files",
    "stdlib_dir",
    "stdlib_source_files",
    "worker_settings",
]
