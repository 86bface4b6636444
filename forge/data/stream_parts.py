"""What is built on a stream (forge/data/streams.py), exactly resumable like the stream itself:
documents tokenized on the fly and packed into fixed blocks (``PackedStream``), several streams
mixed with weights (``MixedStream``, ``datasets.interleave_datasets``' semantics), and the
standard library's files as a sharded stream of documents (``text_files_stream``)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from forge.data.streams import (
    ShardCursor,
    ShardedStream,
    ShardReader,
    SlotStream,
    StreamSource,
    stream_source,
)

__all__ = ["MixedStream", "PackedStream", "read_document", "text_files_stream"]


# --------------------------------------------------------------------------- packing
class PackedStream:
    """The documents of ``dataset`` (a stream; each item's ``text_column``) tokenized as they
    are read, each followed by the eos token, concatenated and cut into blocks of
    ``block_size`` tokens, the remainder carried to the next block (LLM pretraining's packing).
    Items are ``{"input_ids": int64 tensor [block_size]}``; labels are the inputs, as for
    ``PackedTextDataset``. The carried tokens are part of the stream's position."""

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        *,
        block_size: int = 128,
        text_column: str = "text",
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer (got {block_size!r})")
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer has no eos_token; set tokenizer.eos_token first")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.block_size, self.text_column = block_size, text_column

    def stream_source(self) -> StreamSource:
        return PackedSource(self)

    def __repr__(self) -> str:
        return f"PackedStream({self.dataset!r}, block_size={self.block_size})"


class PackedSource(StreamSource):
    """The blocks of a :class:`PackedStream`, shard by shard. The tokens carried over are the
    source's own state (one source per slot: each loader worker reads its own copy), saved
    with the slot's position, so they carry across shards and epochs too."""

    def __init__(self, packed: PackedStream) -> None:
        from forge.data.datasets import tokenize_and_pack

        self.packed, self.inner = packed, stream_source(packed.dataset)
        self.num_shards, self.stateful = self.inner.num_shards, self.inner.stateful
        self.carry = torch.zeros(0, dtype=torch.int64)
        self._tokenize = tokenize_and_pack

    def shard_name(self, shard: int) -> str:
        return self.inner.shard_name(shard)

    def state(self) -> Any:
        return self.carry.clone()

    def restore(self, state: Any) -> None:
        self.carry = state.clone()

    def open(self, shard: int, epoch: int, position: Any) -> ShardCursor:
        packed, size = self.packed, self.packed.block_size
        documents = self.inner.open(shard, epoch, position)
        eos = int(packed.tokenizer.eos_token_id)

        def split_blocks():
            while len(self.carry) >= size:
                block, self.carry = self.carry[:size].clone(), self.carry[size:]
                yield {"input_ids": block}

        def blocks():
            # a resumed shard gives the blocks its restored carry still holds first: its
            # documents may all be read already (the straight run drained them in this shard)
            yield from split_blocks()
            for document in documents.items:
                text = document[packed.text_column]
                if not isinstance(text, str):
                    raise TypeError(
                        f"item column {packed.text_column!r} is {type(text).__name__}, not text"
                    )
                tokens = self._tokenize(packed.tokenizer, [text], eos)
                # the carry is every token not yet given out (a document can fill several
                # blocks: those still to come are part of the position too)
                self.carry = torch.cat([self.carry, torch.from_numpy(tokens.astype("int64"))])
                yield from split_blocks()

        return ShardCursor(blocks(), documents.position)


# --------------------------------------------------------------------------- mixtures
class MixedStream:
    """Items drawn from ``datasets`` (streams) with ``probabilities`` (default: equal), as
    ``datasets.interleave_datasets`` does, each source read through its own shards, shuffle
    buffer and epochs (endless: a source that ends its epoch starts the next). A source with
    nothing for a rank's loader worker is left out of that worker's draws. Every source's
    position and the draws so far are the mixture's position."""

    def __init__(
        self, datasets: Sequence[Any], probabilities: Sequence[float] | None = None
    ) -> None:
        datasets = list(datasets)
        if not datasets:
            raise ValueError("MixedStream needs at least one stream")
        weights = [1.0] * len(datasets) if probabilities is None else list(probabilities)
        if len(weights) != len(datasets) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"probabilities must be {len(datasets)} non-negative numbers with a positive "
                f"sum (got {probabilities!r})"
            )
        self.datasets = datasets
        self.probabilities = [w / sum(weights) for w in weights]

    def stream_source(self) -> StreamSource:
        source = StreamSource()
        source.num_shards = sum(stream_source(d).num_shards for d in self.datasets)
        return source

    def slot_stream(self, stream: ShardedStream, slot: int, slots: int) -> MixedSlot:
        parts = []
        for index, dataset in enumerate(self.datasets):
            part = ShardedStream(
                dataset,
                rank=stream.rank,
                world_size=stream.world_size,
                seed=stream.seed + index,
                shuffle=stream.shuffle,
                shuffle_buffer=stream.shuffle_buffer,
            )
            parts.append(SlotStream(part, slot, slots))
        return MixedSlot(parts, self.probabilities, stream.seed, slot)

    def __repr__(self) -> str:
        return f"MixedStream({len(self.datasets)} streams, probabilities={self.probabilities})"


class MixedSlot:
    """One slot's mixture: a Stateful iterator over its sources' slot streams."""

    def __init__(self, parts: list[SlotStream], probabilities: list[float], seed: int, slot: int):
        self.parts, self.probabilities, self.seed, self.slot = parts, probabilities, seed, slot
        self.draws = 0
        self.ended = [False] * len(parts)

    def __iter__(self) -> MixedSlot:
        return self

    def __next__(self) -> Any:
        while not all(self.ended):
            index = self._pick()
            try:
                return next(self.parts[index])
            except StopIteration:
                self.ended[index] = True
        raise StopIteration

    def _pick(self) -> int:
        text = f"mix:{self.seed}:{self.slot}:{self.draws}".encode()
        self.draws += 1
        uniform = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") / 2**64
        live = [(i, p) for i, p in enumerate(self.probabilities) if not self.ended[i]]
        total = sum(p for _, p in live)
        for index, probability in live:
            uniform -= probability / total
            if uniform < 0:
                return index
        return live[-1][0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "parts": [part.state_dict() for part in self.parts],
            "draws": self.draws,
            "ended": list(self.ended),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, saved in zip(self.parts, state["parts"], strict=True):
            part.load_state_dict(saved)
        self.draws, self.ended = int(state["draws"]), list(state["ended"])


# --------------------------------------------------------------------------- text files
def read_document(path: str) -> list[dict[str, str]]:
    """One file as one document: ``[{"text": its contents}]`` (UTF-8; bad bytes replaced)."""
    return [{"text": Path(path).read_text(encoding="utf-8", errors="replace")}]


def text_files_stream(
    files: Sequence[str | Path] | None = None,
    *,
    split: str = "train",
    max_files: int | None = None,
) -> ShardReader:
    """Text files as a sharded stream, each file a shard holding one document (``{"text"}``):
    ``files``, or the running Python's standard library sources of ``split`` (as
    ``PackedTextDataset`` reads them)."""
    from forge.data.corpus import limit_files, stdlib_source_files

    if files is None:
        paths = stdlib_source_files(split, max_files=max_files)
    else:
        paths = limit_files(files, max_files)
    if not paths:
        raise ValueError("text_files_stream found no files")
    return ShardReader([str(p) for p in paths], read_document)
