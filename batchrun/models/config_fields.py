"""What a config.json key's value must be, declared as a Field (a JSON kind and a range), and
the check of a table of them against a config: one line naming the file, the key and what is
wrong, before anything is built from the value."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from batchrun.errors import JobError

# A kind: one value's description, a list's, and the test of one value (a bool is no integer
# or number here, though Python's bool is an int).
_KINDS: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "integer": (
        "an integer",
        "a list of integers",
        lambda v: isinstance(v, int) and not isinstance(v, bool),
    ),
    "number": (
        "a finite number",
        "a list of finite numbers",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    ),
    "boolean": ("true or false", "a list of booleans", lambda v: isinstance(v, bool)),
    "string": ("a string", "a list of strings", lambda v: isinstance(v, str)),
    "object": ("an object", "a list of objects", lambda v: isinstance(v, dict)),
}


@dataclass(frozen=True)
class Field:
    """A key's value: one of a kind (_KINDS), with shape "list" a list of them, with "either"
    one or a list; each within [low, high] (low itself excluded with `above`). Null only with
    `null`; with `required` the key must be there."""

    kind: str
    low: float | None = None
    high: float | None = None
    above: bool = False
    shape: str = "one"
    null: bool = False
    required: bool = False

    def fits(self, value: Any) -> bool:
        if value is None:
            return self.null
        if isinstance(value, list) and self.shape != "one":
            return all(self._fits_one(v) for v in value)
        return self.shape != "list" and self._fits_one(value)

    def _fits_one(self, value: Any) -> bool:
        if not _KINDS[self.kind][2](value):
            return False
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        one, many, _ = _KINDS[self.kind]
        kind = {"one": one, "list": many, "either": f"{one} or {many}"}[self.shape]
        low = "(" if self.above else "["
        if self.low is not None and self.high is not None:
            bounds = f" in {low}{_number(self.low)}, {_number(self.high)}]"
        elif self.low is not None:
            bounds = f" {'>' if self.above else '>='} {_number(self.low)}"
        else:
            bounds = ""
        each = " each" if self.shape != "one" and bounds else ""
        return f"{kind}{each}{bounds}" + (" or null" if self.null else "")


def check_fields(
    config: Mapping[str, Any], table: Mapping[str, Field], where: str, owner: str, prefix: str = ""
) -> None:
    """JobError for the first key of `table` whose value in `config` breaks its Field, or that
    is required and missing. where: the file ("target: /m/config.json"); owner: what needs a
    missing key ("qwen3", "yarn"); prefix: the keys' place in the file ("rope_scaling.")."""
    for key, field in table.items():
        if key not in config:
            if field.required:
                place = f" in {prefix.rstrip('.')}" if prefix else ""
                raise JobError(f"{where}: {owner} needs {key}{place}")
            continue
        value = config[key]
        if not field.fits(value):
            raise JobError(
                f"{where}: {prefix}{key} must be {field.describe()}, got {_shown(value)}"
            )


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _shown(value: Any) -> str:
    """A value as config.json spells it, cut to fit an error line."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
