"""A byte-level BPE tokenizer trained once on the corpus and cached on disk.

The cache directory ``<cache_dir>/tokenizer-bpe-<vocab_size>/`` is a normal Hugging Face
tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``), so it can be copied
into checkpoints and loaded with ``AutoTokenizer.from_pretrained``. Concurrent builders
(several ranks, or two jobs sharing a cache) serialise on a lock file; the tokenizer is
built in a temporary directory and renamed into place, so a reader never sees a partial one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from forge.data._files import exclusive_lock, remove_leftovers
from forge.data.corpus import limit_files, read_text_files, stdlib_source_files

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TRAINING_INFO = "forge_tokenizer.json"
_MIN_VOCAB = 256 + 1  # every byte plus the special token


def tokenizer_cache_path(cache_dir: str | os.PathLike[str], vocab_size: int) -> Path:
    """Where :func:`load_or_train_tokenizer` keeps the tokenizer for ``vocab_size``."""
    return Path(cache_dir) / f"tokenizer-bpe-{vocab_size}"


def load_or_train_tokenizer(
    cache_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    files: Sequence[str | os.PathLike[str]] | None = None,
    max_files: int | None = None,
    model_max_length: int = 2048,
) -> PreTrainedTokenizerFast:
    """The cached byte-level BPE tokenizer for ``vocab_size``, training it on first use.

    Trains on ``files`` (the first ``max_files`` of them) or, by default, on the train split
    of the standard library sources. ``<|endoftext|>`` (id 0) is the bos, eos and pad token.
    Once built, the cached tokenizer is reused as is; a mismatch between the requested
    training settings and the cached ones is logged, and deleting the directory retrains.
    """
    _check_positive_int("vocab_size", vocab_size, minimum=_MIN_VOCAB)
    _check_positive_int("min_frequency", min_frequency)
    _check_positive_int("model_max_length", model_max_length)
    if cache_dir is None or str(cache_dir) == "":
        raise ValueError("cache_dir must be a directory path where the tokenizer is cached")
    target = tokenizer_cache_path(cache_dir, vocab_size)
    target.parent.mkdir(parents=True, exist_ok=True)

    if not _is_complete(target):
        with exclusive_lock(target.with_name(target.name + ".lock")):
            if not _is_complete(target):  # another process may have built it while we waited
                remove_leftovers(target.parent, f".{target.name}.tmp-*")
                paths = _training_files(files, max_files)
                _build(target, paths, vocab_size=vocab_size, min_frequency=min_frequency)
    _warn_on_setting_mismatch(target, files, max_files, vocab_size, min_frequency)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.model_max_length = model_max_length
    return tokenizer


def train_bpe_tokenizer(
    texts: Sequence[str], *, vocab_size: int = 4096, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` in memory (no caching)."""
    if not texts:
        raise ValueError("cannot train a tokenizer on no text; pass files or texts that exist")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def _training_files(
    files: Sequence[str | os.PathLike[str]] | None, max_files: int | None
) -> list[Path]:
    if files is None:
        paths = stdlib_source_files("train", max_files=max_files)
    else:
        paths = limit_files(files, max_files)
    if not paths:
        raise ValueError(
            "files: no training files; pass files=[...] or leave it None for the stdlib"
        )
    return paths


def _build(target: Path, paths: list[Path], *, vocab_size: int, min_frequency: int) -> None:
    started = time.perf_counter()
    texts = read_text_files(paths)
    tokenizer = train_bpe_tokenizer(texts, vocab_size=vocab_size, min_frequency=min_frequency)
    seconds = time.perf_counter() - started
    info = _settings(paths, vocab_size, min_frequency) | {
        "num_files": len(paths),
        "num_chars": sum(len(t) for t in texts),
        "train_seconds": round(seconds, 3),
    }
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer.save_pretrained(staging)
        (staging / TRAINING_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if target.exists():  # an incomplete leftover from an older, interrupted layout
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "trained a %d-token BPE tokenizer on %d files in %.1f s -> %s",
        vocab_size,
        len(paths),
        seconds,
        target,
    )


def _settings(paths: Sequence[Path], vocab_size: int, min_frequency: int) -> dict[str, object]:
    listing = "\n".join(str(p) for p in paths).encode()
    return {
        "vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "files_sha256": hashlib.sha256(listing).hexdigest(),
    }


def _warn_on_setting_mismatch(
    target: Path,
    files: Sequence[str | os.PathLike[str]] | None,
    max_files: int | None,
    vocab_size: int,
    min_frequency: int,
) -> None:
    try:
        cached = json.loads((target / TRAINING_INFO).read_text())
        wanted = _settings(_training_files(files, max_files), vocab_size, min_frequency)
    except (OSError, ValueError):
        return
    if any(cached.get(key) != value for key, value in wanted.items()):
        logger.warning(
            "reusing the tokenizer in %s, which was trained with other files or min_frequency "
            "than requested; delete that directory to retrain",
            target,
        )


def _is_complete(target: Path) -> bool:
    return (target / "tokenizer.json").is_file() and (target / TRAINING_INFO).is_file()


def _check_positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r})")
