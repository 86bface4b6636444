"""``remove_unused_columns``: drop the dataset columns the model's ``forward`` does not take.

As Hugging Face's Trainer does: the columns kept are ``forward``'s parameter names plus the
label names (and ``label`` / ``label_ids``, which collators rename). A Hugging Face
``datasets.Dataset`` loses the other columns once (``remove_columns``); any other dataset's
items lose them in the collator. Either way one log line names what was dropped, so a leftover
``text`` column never reaches a padding collator (whose error would blame truncation).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["RemoveColumnsCollator", "remove_unused_columns", "signature_columns"]


def signature_columns(model: Any, label_names: Sequence[str]) -> list[str]:
    """The batch keys ``model`` can take: ``forward``'s parameters and the label names."""
    from forge.train.evaluation import unwrap

    names = list(inspect.signature(unwrap(model).forward).parameters)
    return names + sorted({"label", "label_ids", *label_names} - set(names))


def _describe(model: Any) -> str:
    from forge.train.evaluation import unwrap

    return f"{type(unwrap(model)).__name__}.forward"


def _no_match(model: Any, columns: list[str], ignored: list[str]) -> ValueError:
    return ValueError(
        f"no column of the dataset is an argument of {_describe(model)} ({', '.join(columns)}); "
        f"the dataset has {', '.join(ignored)}. Tokenize the data into the model's inputs, or "
        "set trainer.args.remove_unused_columns: false"
    )


class RemoveColumnsCollator:
    """Drops the keys ``columns`` does not name from each item, then calls ``collator``
    (torch's default collation when None). Logs the dropped keys once."""

    def __init__(
        self,
        collator: Callable[[list[Any]], Any] | None,
        columns: Sequence[str],
        *,
        model_name: str = "the model's forward",
        description: str = "",
    ) -> None:
        if collator is None:
            from torch.utils.data import default_collate

            collator = default_collate
        self.collator = collator
        self.columns = set(columns)
        self.model_name = model_name
        self.description = description
        self._logged = False

    def __call__(self, items: list[Any]) -> Any:
        if items and isinstance(items[0], Mapping):
            if not self._logged:
                self._log(items[0])
            items = [{k: v for k, v in item.items() if k in self.columns} for item in items]
        return self.collator(items)

    def _log(self, item: Mapping[str, Any]) -> None:
        self._logged = True
        ignored = sorted(set(item) - self.columns)
        if not set(item) & self.columns:
            raise ValueError(
                f"no key of the {self.description or 'dataset'} items is an argument of "
                f"{self.model_name} ({', '.join(sorted(self.columns))}); the items have "
                f"{', '.join(ignored)}. Tokenize the data into the model's inputs, or set "
                "trainer.args.remove_unused_columns: false"
            )
        if ignored:
            logger.info(
                "remove_unused_columns: dropping %s from the %sitems: %s does not take %s",
                ", ".join(ignored),
                f"{self.description} " if self.description else "",
                self.model_name,
                "it" if len(ignored) == 1 else "them",
            )

    def __repr__(self) -> str:
        return f"RemoveColumnsCollator({self.collator!r}, columns={sorted(self.columns)})"


def remove_unused_columns(
    dataset: Any,
    collator: Callable[[list[Any]], Any] | None,
    model: Any,
    label_names: Sequence[str],
    description: str = "",
) -> tuple[Any, Callable[[list[Any]], Any] | None]:
    """``(dataset, collator)`` that give the model only the columns its ``forward`` takes."""
    columns = signature_columns(model, label_names)
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list) and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
        ignored = [c for c in names if c not in columns]
        if ignored and len(ignored) == len(names):
            raise _no_match(model, columns, ignored)
        if ignored:
            logger.info(
                "remove_unused_columns: dropping %s from the %sdataset: %s does not take %s",
                ", ".join(ignored),
                f"{description} " if description else "",
                _describe(model),
                "it" if len(ignored) == 1 else "them",
            )
            dataset = dataset.remove_columns(ignored)
        return dataset, collator
    wrapped = RemoveColumnsCollator(
        collator, columns, model_name=_describe(model), description=description
    )
    return dataset, wrapped
