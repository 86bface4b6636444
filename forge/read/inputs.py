"""The input lines of ``forge predict``: text for a tokenizer, or a model's inputs as they are.

A line is a JSON object (or a bare JSON string, taken as its text). A file is either all text
rows (each with the text field) or all rows of model inputs (``{"input_ids": [...]}``,
``{"x": [[...]]}``): one example each, without a batch dimension, under the names its model's
forward takes. Rows of inputs are checked against that forward before any of them runs, so a
misnamed key costs seconds, not a pass over the file.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

from forge.read.errors import ReadFailure, ReadUsageError
from forge.wrappers import class_label

__all__ = [
    "InputRows",
    "check_input_keys",
    "has_tokenizer",
    "no_tokenizer",
    "read_rows",
    "row_tensors",
]

EXAMPLE = '{"input_ids": [1, 2, 3]}'


@dataclasses.dataclass
class InputRows:
    """The lines of an input file: ``rows`` (dicts), their line ``numbers``, and whether they
    are text rows (``text``) or rows of model inputs."""

    path: Path
    rows: list[dict[str, Any]]
    numbers: list[int]
    text: bool
    _float_keys: set[str] | None = dataclasses.field(default=None, repr=False)

    def where(self, index: int) -> str:
        return f"{self.path}:{self.numbers[index]}"

    def float_keys(self) -> set[str]:
        """The keys that hold a number with a point on some line."""
        if self._float_keys is None:
            self._float_keys = {k for row in self.rows for k, v in row.items() if _has_float(v)}
        return self._float_keys


def read_rows(path: Path, field: str) -> InputRows:
    """Read JSON Lines: a row with ``field`` (a string) is text, a row without it holds model
    inputs; a file mixing the two is refused at the first row that differs."""
    rows, numbers = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ReadFailure(f"cannot read {path}: {err.strerror or err}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ReadFailure(f"{path}:{number}: not a JSON line ({err})") from None
        if isinstance(row, str):
            row = {field: row}
        # a string is no model input: a row holding one is text under another name
        if not isinstance(row, dict) or (
            not isinstance(row[field], str)
            if field in row
            else any(isinstance(value, str) for value in row.values())
        ):
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise ReadUsageError(
                f"{path}:{number}: needs a string field {field!r} (found {keys}); "
                "name the text field with --text-field, or give the model's inputs without "
                f"it, e.g. {EXAMPLE}"
            )
        if not row:
            raise ReadUsageError(
                f"{path}:{number}: an empty object; give a {field!r} or the inputs"
            )
        if rows and (field in row) != (field in rows[0]):
            first = "text" if field in rows[0] else "model inputs"
            raise ReadUsageError(
                f"{path}:{number}: a row of {'text' if field in row else 'model inputs'} "
                f"({', '.join(row)}) after rows of {first} (line {numbers[0]}); give every line "
                f"its text as {field!r}, or every line the model's inputs"
            )
        rows.append(row)
        numbers.append(number)
    if not rows:
        raise ReadUsageError(f"{path} has no input lines")
    return InputRows(Path(path), rows, numbers, text=field in rows[0])


def _forward_parameters(model: Any) -> list[inspect.Parameter]:
    """The named parameters of the forward rows are given to (through LossAdapter and other
    wrappers); ``model`` is a module or a module class."""
    from torch import nn

    from forge.wrappers import unwrap_model

    if isinstance(model, nn.Module):
        model = unwrap_model(model, through_adapters=True)
    parameters = list(inspect.signature(model.forward).parameters.values())
    if isinstance(model, type):
        parameters = parameters[1:]  # self
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p for p in parameters if p.kind in kinds]


def check_input_keys(model: Any, inputs: InputRows, *, needs: str | None = None) -> None:
    """Refuse (exit 2) a row whose key ``model``'s forward does not take, or that lacks an
    argument it needs (one without a default, or ``needs``: a transformers model's main
    input), naming the row and the forward's parameters."""
    parameters = _forward_parameters(model)
    names = [p.name for p in parameters]
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    if needs and needs not in required:
        required.append(needs)
    label = class_label(_unwrapped(model))
    signature = f"{label}.forward({', '.join(names)})"
    for index, row in enumerate(inputs.rows):
        unknown = [key for key in row if key not in names]
        if unknown:
            raise ReadUsageError(
                f"{inputs.where(index)}: {signature} takes no {unknown[0]!r}; name each of a "
                "line's model inputs as forward does (one example, no batch dimension), or give "
                "a line of text as 'text' (--text-field names another field)"
            )
        missing = [name for name in required if name not in row]
        if missing:
            raise ReadUsageError(
                f"{inputs.where(index)}: {signature} needs {missing[0]!r}, which the line "
                f"lacks (it has {', '.join(row)})"
            )


def _unwrapped(model: Any) -> Any:
    from torch import nn

    from forge.wrappers import unwrap_model

    return unwrap_model(model, through_adapters=True) if isinstance(model, nn.Module) else model


def row_tensors(inputs: InputRows, index: int, dtype: Any = None) -> dict[str, Any]:
    """One row of model inputs as a batch of one: each value a tensor with a leading batch
    dimension. A key with a number with a point on any line is ``dtype`` (the model's float
    dtype; float32 without one) on every line, so that ``[0, 1]`` beside ``[0.5, 1.5]`` is
    floats too; other integers are int64, true/false bool."""
    import torch

    tensors = {}
    for key, value in inputs.rows[index].items():
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as err:
            kind = type(value).__name__
            raise ReadUsageError(
                f"{inputs.where(index)}: {key!r} is no tensor ({kind}: {err}); a line of model "
                "inputs holds numbers or equal-length lists of them, one example each"
            ) from None
        if key in inputs.float_keys():
            tensor = tensor.to(dtype or torch.get_default_dtype())
        tensors[key] = tensor.unsqueeze(0)
    return tensors


def _has_float(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_float(item) for item in value)
    return isinstance(value, float)


def no_tokenizer(checkpoint: Path, label: str, instead: str) -> ReadUsageError:
    """The refusal for text given to a model whose checkpoint holds no tokenizer."""
    return ReadUsageError(
        f"{checkpoint} holds no tokenizer (no tokenizer.json or tokenizer_config.json) to turn "
        f"text into the token ids of its {label}; {instead} (a trainer given a tokenizer "
        "saves it in each checkpoint)"
    )


def has_tokenizer(checkpoint: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json")
    return any((Path(checkpoint) / name).is_file() for name in names)
