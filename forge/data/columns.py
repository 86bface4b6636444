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
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "ModelInputs",
    "RemoveColumnsCollator",
    "keep_model_inputs",
    "remove_unused_columns",
    "signature_columns",
]


def signature_columns(model: Any, label_names: Sequence[str]) -> list[str]:
    """The batch keys ``model`` can take: ``forward``'s parameters and the label names.

    ``model`` is a module or a module class whose ``forward`` names the inputs (the caller
    looks through wrappers such as DDP first)."""
    names = list(inspect.signature(model.forward).parameters)
    if isinstance(model, type):
        names = names[1:]  # self
    return names + sorted({"label", "label_ids", *label_names} - set(names))


def forward_name(model: Any) -> str:
    """``Net.forward``: the forward of a module or module class, for messages."""
    return f"{(model if isinstance(model, type) else type(model)).__name__}.forward"


@dataclass(frozen=True)
class ModelInputs:
    """What ``remove_unused_columns`` keeps: the batch keys a model's ``forward`` takes (its
    parameters and the label names), and that forward's name for messages."""

    columns: tuple[str, ...]
    forward: str = "the model's forward"

    @classmethod
    def of(cls, model: Any, label_names: Sequence[str]) -> ModelInputs:
        """The inputs of ``model`` (a module or module class, unwrapped)."""
        return cls(tuple(signature_columns(model, label_names)), forward_name(model))


def _no_match(inputs: ModelInputs, ignored: list[str]) -> ValueError:
    return ValueError(
        f"no column of the dataset is an argument of {inputs.forward} "
        f"({', '.join(inputs.columns)}); the dataset has {', '.join(ignored)}. Tokenize the data "
        "into the model's inputs, or set trainer.args.remove_unused_columns: false"
    )


def removed_column_note(error: BaseException, removed: Sequence[str], forward: str) -> str | None:
    """What to say of a collator's ``KeyError`` for a column ``remove_unused_columns`` removed
    before the collator saw the items, or None for another error."""
    if not isinstance(error, KeyError) or not error.args or error.args[0] not in removed:
        return None
    return (
        f"remove_unused_columns removed the column {error.args[0]!r} before the collator ran "
        f"({forward} does not take it); a collator that reads it needs "
        "trainer.args.remove_unused_columns: false"
    )


class RemovedColumnError(KeyError):
    """A collator read a column ``remove_unused_columns`` had removed."""

    def __str__(self) -> str:  # KeyError's would quote the whole message
        return str(self.args[0])


class RemoveColumnsCollator:
    """Drops the keys ``columns`` does not name from each item, then calls ``collator``
    (torch's default collation when None). Logs the dropped keys once, unless ``quiet`` (a
    check before training, whose trainer logs them)."""

    def __init__(
        self,
        collator: Callable[[list[Any]], Any] | None,
        columns: Sequence[str],
        *,
        model_name: str = "the model's forward",
        description: str = "",
        quiet: bool = False,
    ) -> None:
        if collator is None:
            from torch.utils.data import default_collate

            collator = default_collate
        self.collator = collator
        self.columns = set(columns)
        self.model_name = model_name
        self.description = description
        self.quiet = quiet
        self._logged = False

    def __call__(self, items: list[Any]) -> Any:
        if items and isinstance(items[0], Mapping):
            if not self._logged:
                self._log(items[0])
            removed = sorted(set(items[0]) - self.columns)
            items = [{k: v for k, v in item.items() if k in self.columns} for item in items]
            try:
                return self.collator(items)
            except KeyError as err:
                note = removed_column_note(err, removed, self.model_name)
                if note is None:
                    raise
                raise RemovedColumnError(f"KeyError: {err}: {note}") from err
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
        if ignored and not self.quiet:
            logger.info(
                "remove_unused_columns: dropping %s from the %sitems: %s does not take %s",
                ", ".join(ignored),
                f"{self.description} " if self.description else "",
                self.model_name,
                "it" if len(ignored) == 1 else "them",
            )

    def __repr__(self) -> str:
        return f"RemoveColumnsCollator({self.collator!r}, columns={sorted(self.columns)})"


def keep_model_inputs(
    dataset: Any,
    collator: Callable[[list[Any]], Any] | None,
    inputs: ModelInputs,
    description: str = "",
    *,
    quiet: bool = False,
) -> tuple[Any, Callable[[list[Any]], Any] | None]:
    """``(dataset, collator)`` that give the model only the columns ``inputs`` names; one log
    line names the columns dropped, unless ``quiet``."""
    columns = inputs.columns
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list) and hasattr(dataset, "remove_columns"):  # a datasets.Dataset
        ignored = [c for c in names if c not in columns]
        if ignored and len(ignored) == len(names):
            raise _no_match(inputs, ignored)
        if ignored and not quiet:
            logger.info(
                "remove_unused_columns: dropping %s from the %sdataset: %s does not take %s",
                ", ".join(ignored),
                f"{description} " if description else "",
                inputs.forward,
                "it" if len(ignored) == 1 else "them",
            )
        if ignored:
            dataset = dataset.remove_columns(ignored)
        return dataset, collator
    wrapped = RemoveColumnsCollator(
        collator, columns, model_name=inputs.forward, description=description, quiet=quiet
    )
    return dataset, wrapped


def remove_unused_columns(
    dataset: Any,
    collator: Callable[[list[Any]], Any] | None,
    model: Any,
    label_names: Sequence[str],
    description: str = "",
) -> tuple[Any, Callable[[list[Any]], Any] | None]:
    """``(dataset, collator)`` that give ``model`` (unwrapped) only the columns its
    ``forward`` takes."""
    return keep_model_inputs(dataset, collator, ModelInputs.of(model, label_names), description)
