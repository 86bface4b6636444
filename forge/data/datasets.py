"""Packed language-modelling datasets: documents joined into one token stream, cut in blocks."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from forge.data._files import atomic_write, exclusive_lock, remove_leftovers
from forge.data.corpus import limit_files, read_text_files, stdlib_source_files

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1


class PackedTextDataset(Dataset):
    """Fixed-length blocks cut from the concatenated token stream of a set of documents.

    Documents are the stdlib source files of ``split`` (default), or ``files``, or ``texts``.
    Each is tokenized without special tokens and followed by the eos token; the stream is cut
    into non-overlapping blocks of ``block_size`` tokens and the ragged tail is dropped.
    Item ``i`` is ``{"input_ids": stream[i * block_size:(i + 1) * block_size]}`` as int64;
    labels equal the inputs and the model shifts them, as Hugging Face causal LMs do.

    With ``cache_dir``, the token stream is cached as ``.npy`` keyed by the tokenizer, the
    documents (path, size, mtime; or the texts themselves) and the eos id, so a second build
    skips tokenization. ``num_tokens`` is the stream length, eos separators included.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        split: str = "train",
        block_size: int = 128,
        texts: Sequence[str] | None = None,
        files: Sequence[str | os.PathLike[str]] | None = None,
        max_files: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        eval_fraction: float = 0.05,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer (got {block_size!r})")
        if texts is not None and files is not None:
            raise ValueError("pass either texts or files to PackedTextDataset, not both")
        if texts is not None and (
            isinstance(texts, str) or not all(isinstance(t, str) for t in texts)
        ):
            raise ValueError("texts must be a list of strings; pass file paths as files=[...]")
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token; set tokenizer.eos_token first")
        self.block_size = block_size
        self.eos_token_id = int(tokenizer.eos_token_id)

        if texts is not None:
            documents: Sequence[str] | list[Path] = list(texts)
            source = "texts"
        elif files is not None:
            documents = limit_files(files, max_files)
            source = "files"
        else:
            documents = stdlib_source_files(split, eval_fraction=eval_fraction, max_files=max_files)
            source = f"stdlib {split} split"
        if not documents:
            raise ValueError(f"PackedTextDataset got no documents from {source}")

        self.tokens = self._load_or_tokenize(tokenizer, documents, cache_dir)
        self.num_tokens = int(self.tokens.shape[0])
        self._num_blocks = self.num_tokens // block_size
        if self._num_blocks == 0:
            raise ValueError(
                f"{source} has {self.num_tokens} tokens, fewer than block_size={block_size}; "
                "lower block_size or add documents"
            )
        logger.info(
            "%s: %d documents, %d tokens, %d blocks of %d",
            source,
            len(documents),
            self.num_tokens,
            self._num_blocks,
            block_size,
        )

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._num_blocks
        if not 0 <= index < self._num_blocks:
            raise IndexError(f"block {index} out of range for {self._num_blocks} blocks")
        start = index * self.block_size
        block = self.tokens[start : start + self.block_size].astype(np.int64)
        return {"input_ids": torch.from_numpy(block)}

    def __repr__(self) -> str:
        return (
            f"PackedTextDataset(blocks={self._num_blocks}, block_size={self.block_size}, "
            f"num_tokens={self.num_tokens})"
        )

    def _load_or_tokenize(
        self,
        tokenizer: PreTrainedTokenizerBase,
        documents: Sequence[str] | list[Path],
        cache_dir: str | os.PathLike[str] | None,
    ) -> np.ndarray:
        if cache_dir is None:
            return self._tokenize(tokenizer, documents)
        key = _cache_key(tokenizer, documents, self.eos_token_id)
        cache_file = Path(cache_dir) / f"tokens-{key}.npy"
        # one process tokenizes while the others (e.g. the other ranks) wait, then load
        with exclusive_lock(cache_file.with_name(cache_file.name + ".lock")):
            if cache_file.is_file():
                logger.debug("loading cached tokens from %s", cache_file)
                return np.load(cache_file)
            remove_leftovers(cache_file.parent, f".{cache_file.name}.*.tmp")
            tokens = self._tokenize(tokenizer, documents)
            atomic_write(cache_file, lambda handle: np.save(handle, tokens))
            logger.info("tokenized %d documents into %s", len(documents), cache_file)
        return tokens

    def _tokenize(
        self, tokenizer: PreTrainedTokenizerBase, documents: Sequence[str] | list[Path]
    ) -> np.ndarray:
        if not isinstance(documents[0], str):
            documents = read_text_files(documents)
        return tokenize_and_pack(tokenizer, documents, self.eos_token_id)


def tokenize_and_pack(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], eos_token_id: int
) -> np.ndarray:
    """One token stream: each text's ids (no special tokens) followed by ``eos_token_id``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: parallel, no length warnings
        ids = [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=False)]
    else:
        ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces: list[np.ndarray] = []
    eos = np.array([eos_token_id], dtype=dtype)
    for doc in ids:
        pieces.append(np.asarray(doc, dtype=dtype))
        pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def _cache_key(
    tokenizer: PreTrainedTokenizerBase, documents: Sequence[str] | list[Path], eos_token_id: int
) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = (
        backend.to_str()
        if backend is not None
        else json.dumps(sorted(tokenizer.get_vocab().items()))
    )
    header = {
        "format": _CACHE_FORMAT,
        "eos": eos_token_id,
        "vocab": hashlib.sha256(vocab.encode()).hexdigest(),
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    for doc in documents:
        if isinstance(doc, str):
            digest.update(hashlib.sha256(doc.encode()).digest())
        else:
            stat = doc.stat()
            digest.update(f"{doc.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]
