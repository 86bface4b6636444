"""How one training argument's value is checked and normalised (YAML-friendly values in, the
stored type out), for ``TrainingArguments`` and the trainers' own argument classes.

Each check appends a message naming the full config key to the problem list ``p`` and, when
the value is good, stores it in its normalised form (``"3e-4"`` as ``0.0003``, a list as a
tuple where the field stores one). Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, ClassVar

#: the words of a choice that YAML turns into each boolean when they are not quoted
_BOOLEAN_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


class ValueChecks:
    """The per-value checks the argument classes' ``_check_*`` methods are written with."""

    #: prefix of every key named in an error message (set by the argument class)
    config_key: ClassVar[str]

    def _key(self, name: str) -> str:
        return f"{self.config_key}.{name}"

    def _bool(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            p.append(f"{self._key(name)} must be true or false (got {value!r})")

    def _optional_bool(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if value is not None and not isinstance(value, bool):
            p.append(f"{self._key(name)} must be true, false or null (got {value!r})")

    def _string(self, name: str, p: list[str]) -> None:
        value = getattr(self, name)
        if not isinstance(value, str) or not value:
            p.append(f"{self._key(name)} must be a non-empty string (got {value!r})")

    def _dict(self, name: str, p: list[str]) -> None:
        """A mapping, null, or (as HF's command line allows) a JSON object in a string."""
        value = getattr(self, name)
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if value is not None and not isinstance(value, dict):
            p.append(f"{self._key(name)} must be a mapping of keywords or null (got {value!r})")
            return
        setattr(self, name, value)

    def _choice(self, name: str, choices: tuple[str, ...], p: list[str], fix: str = "") -> None:
        value = getattr(self, name)
        if isinstance(value, bool) and value not in choices:
            # YAML 1.1 reads an unquoted no/yes/off/on as a boolean: take the word meant
            meant = [word for word in _BOOLEAN_WORDS[value] if word in choices]
            if meant:
                setattr(self, name, meant[0])
                return
            fix = (
                "(YAML reads an unquoted yes/no/on/off as a boolean: quote the word, e.g. "
                f'{name}: "{choices[0]}")'
            )
        if value not in choices:
            p.append(
                f"{self._key(name)} must be one of {quoted(choices)} (got {value!r})"
                + (f" {fix}" if fix else "")
            )

    def _interval(self, name: str, p: list[str], fix: str) -> None:
        """A step interval: an integer >= 1, or a fraction of the training steps in (0, 1)."""
        value = as_float(getattr(self, name))
        if value is None or not math.isfinite(value) or value <= 0:
            p.append(
                f"{self._key(name)} must be a positive integer, or a fraction of the training "
                f"steps below 1 (got {getattr(self, name)!r}); {fix}"
            )
        elif value > 1 and not value.is_integer():
            p.append(
                f"{self._key(name)} must be an integer when it is more than 1 "
                f"(got {getattr(self, name)!r}); below 1 it is a fraction of the training steps"
            )
        else:
            setattr(self, name, int(value) if value >= 1 else value)

    def _int(self, name: str, p: list[str], minimum: int, fix: str = "") -> None:
        value = as_int(getattr(self, name))
        if value is None or value < minimum:
            what = {0: "a non-negative integer", 1: "a positive integer"}.get(
                minimum, f"an integer >= {minimum}"
            )
            p.append(
                f"{self._key(name)} must be {what} (got {getattr(self, name)!r})"
                + (f"; {fix}" if fix else "")
            )
            return
        setattr(self, name, value)

    def _optional_int(self, name: str, p: list[str], minimum: int, fix: str = "") -> None:
        if getattr(self, name) is not None:
            self._int(name, p, minimum, fix)

    def _float(
        self,
        name: str,
        p: list[str],
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        positive: bool = False,
        open_max: bool = False,
        fix: str = "",
    ) -> None:
        value = as_float(getattr(self, name))
        bad = value is None or not math.isfinite(value)
        if not bad:
            bad = (
                (positive and value <= 0)
                or (minimum is not None and value < minimum)
                or (maximum is not None and (value >= maximum if open_max else value > maximum))
            )
        if bad:
            if positive:
                what = "a positive number"
            elif maximum is not None:
                what = f"a number in [{minimum}, {maximum}{')' if open_max else ']'}"
            else:
                what = f"a number >= {minimum}"
            p.append(
                f"{self._key(name)} must be {what} (got {getattr(self, name)!r})"
                + (f"; {fix}" if fix else "")
            )
            return
        setattr(self, name, value)


def quoted(names: Iterable[str]) -> str:
    """``"a", "b"``: names as a message lists the choices."""
    return ", ".join(f'"{n}"' for n in names)


def not_multiple(value: float, of: float) -> bool:
    # integer arithmetic, so fractions such as 0.2 and 0.1 compare exactly (as HF does)
    return round(value * 1_000_000) % round(of * 1_000_000) != 0


def as_int(value: Any) -> int | None:
    """An int from an int, an integral float, or a numeric string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number = as_float(value)
    if number is not None and math.isfinite(number) and number.is_integer():
        return int(number)
    return None


def as_float(value: Any) -> float | None:
    """A float from a number or a numeric string such as ``"3e-4"``; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
