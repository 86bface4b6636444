"""Hugging Face ``datasets`` in configs: the tokenisation ``map`` step after ``load_dataset``.

``datasets`` is an optional extra (``pip install 'forge[datasets]'``); the template
``datasets/local_files.yaml`` loads local json / csv / text / parquet files with
``datasets:load_dataset`` (its cache under the project's output) and tokenizes each split
with :func:`tokenize_dataset`, whose ``map`` result ``datasets`` caches next to the loaded
files, keyed by the data, the tokenizer and the settings, so a second run skips it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Tokenize", "tokenize_dataset"]


class Tokenize:
    """The batched ``map`` function: ``tokenizer(texts[, pairs], truncation, max_length)``.

    A plain class (no closure), so ``datasets`` fingerprints it the same way on every run and
    finds its cached result.
    """

    def __init__(
        self,
        tokenizer: Any,
        text_column: str,
        text_pair_column: str | None,
        max_length: int | None,
        truncation: bool,
        padding: bool | str,
    ) -> None:
        self.tokenizer = tokenizer
        self.text_column = text_column
        self.text_pair_column = text_pair_column
        self.max_length = max_length
        self.truncation = truncation
        self.padding = padding

    def __call__(self, batch: dict[str, list[Any]]) -> Any:
        pairs = batch[self.text_pair_column] if self.text_pair_column else None
        return self.tokenizer(
            batch[self.text_column],
            pairs,
            truncation=self.truncation,
            max_length=self.max_length,
            padding=self.padding,
        )


def tokenize_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    text_column: str = "text",
    text_pair_column: str | None = None,
    max_length: int | None = None,
    truncation: bool = True,
    padding: bool | str = False,
    remove_columns: list[str] | None = None,
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> Any:
    """``dataset`` (a ``datasets.Dataset``) with the tokenizer's columns added (``input_ids``,
    ``attention_mask``, ...). The text columns stay unless ``remove_columns`` names them;
    the trainer's ``remove_unused_columns`` drops whatever the model does not take.

    ``max_length`` defaults to the tokenizer's ``model_max_length``; padding is left to the
    collator (``DataCollatorWithPadding``) unless ``padding`` asks for it here.
    """
    columns = list(getattr(dataset, "column_names", None) or [])
    if not hasattr(dataset, "map") or not columns:
        raise TypeError(
            "tokenize_dataset needs a datasets.Dataset (one split of load_dataset's result, "
            f"e.g. !call:operator:getitem [*raw_datasets, train]); got {type(dataset).__name__}"
        )
    for name, column in (("text_column", text_column), ("text_pair_column", text_pair_column)):
        if column is not None and column not in columns:
            raise ValueError(
                f"{name} {column!r} is not a column of the dataset; its columns are "
                f"{', '.join(columns)}"
            )
    function = Tokenize(tokenizer, text_column, text_pair_column, max_length, truncation, padding)
    tokenized = dataset.map(
        function,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=remove_columns,
        desc="tokenizing",
    )
    logger.info(
        "tokenized %d rows (%s) -> columns %s", len(tokenized), text_column, tokenized.column_names
    )
    return tokenized
