"""The text_cls data: short movie reviews written from word lists, and a WordPiece vocabulary.

Everything is generated offline and deterministically (a seeded generator), the first time a
run needs it, under the project's output directory: ``data/train.jsonl`` and
``data/eval.jsonl``, one ``{"text": ..., "label": 0 or 1}`` per line. The tokenizer's
vocabulary is the words of the word lists.
A review's label is its sentiment: 1 (positive) when it has more positive than negative
words, flipped for 5% of the reviews (so accuracy tops out near 95%). Replace ``write_jsonl`` with your own files and keep the format.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

POSITIVE = ["good", "great", "wonderful", "brilliant", "moving", "funny", "clever", "superb"]
NEGATIVE = ["bad", "awful", "boring", "dull", "clumsy", "tedious", "weak", "terrible"]
SUBJECTS = ["the movie", "the film", "the plot", "the acting", "the music", "the ending"]
FILLERS = ["was", "felt", "seemed", "is", "looked", "really", "quite", "and", "but", "very"]
LABEL_NOISE = 0.05
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _review(rng: random.Random) -> dict[str, object]:
    positive = rng.randint(0, 3)
    negative = rng.choice([n for n in range(4) if n != positive])
    words = [rng.choice(POSITIVE) for _ in range(positive)]
    words += [rng.choice(NEGATIVE) for _ in range(negative)]
    rng.shuffle(words)
    parts = [rng.choice(SUBJECTS)]
    for word in words:
        parts += [rng.choice(FILLERS), word]
    label = int(positive > negative)
    if rng.random() < LABEL_NOISE:
        label = 1 - label  # a few reviews are mislabelled, as in real data
    return {"text": " ".join(parts), "label": label}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_jsonl(
    output_root: str, num_train: int = 2000, num_eval: int = 400, seed: int = 0
) -> dict[str, list[str]]:
    """``{"train": [path], "eval": [path]}`` of the generated JSONL files (written once)."""
    directory = Path(output_root) / "data"
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, count, offset in (("train", num_train, 0), ("eval", num_eval, 1)):
        path = directory / f"{split}-{count}-{seed}.jsonl"
        if not path.is_file():
            rng = random.Random(seed * 2 + offset)
            rows = [json.dumps(_review(rng)) for _ in range(count)]
            _write_atomic(path, "\n".join(rows) + "\n")
        files[split] = [str(path)]
    return files


def build_tokenizer(output_root: str, model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """A lower-casing WordPiece tokenizer (BERT's pre-tokenizer and [CLS] ... [SEP] framing)
    whose vocabulary is every word the reviews use, plus the special tokens."""
    words = sorted({w for phrase in SUBJECTS + FILLERS for w in phrase.split()})
    vocab = {
        token: index
        for index, token in enumerate(SPECIAL + sorted(set(words + POSITIVE + NEGATIVE)))
    }
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.BertProcessing(
        ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
    )
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
    )
