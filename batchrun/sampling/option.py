"""How one option is declared: its kind, range, help and where it may be set.

An option is a dataclass field whose metadata holds an `Option` (SamplingParams' fields, the job
spec's parts). Its name and default are the field's; everything else said about it is here, and
the flags, the job's JSON Schema, the per-row override columns and the fingerprint keys are
derived from it (batchrun/config/options.py collects them).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.Enum):
    """What values an option takes: its JSON Schema type, its flag type and its cell type."""

    INT = "integer"
    FLOAT = "number"
    BOOL = "boolean"
    TEXT = "string"
    STRINGS = "strings"  # a list of non-empty strings; a repeatable flag
    TOKEN_IDS = "token_ids"  # a list of integers >= 0; a repeatable flag
    TOKEN_BIAS = "token_bias"  # token id (a decimal string) -> number in [low, high]
    OBJECT = "object"  # a JSON object (a table in TOML, JSON text on the command line)
    SCHEMA = "schema"  # any JSON Schema fragment given in `schema` (json_schema, verify_width)


class Record(enum.Enum):
    """Whether an option is part of the job fingerprint (what changes a job's outputs)."""

    NEVER = "never"
    ALWAYS = "always"
    WHEN_SET = "when_set"  # only away from its default, so older jobs keep their fingerprint


@dataclass(frozen=True)
class Option:
    """One option's declaration. Invariants: `low`/`high` bound a number (for TOKEN_BIAS, the
    bias), `low_open` makes `low` exclusive, `at_most` names the option whose value is its
    upper bound (a rule the schema cannot state); `help` None means no flag; `column` True
    means a per-row cell of the same name overrides the job's value."""

    kind: Kind
    doc: str  # the job schema's description
    help: str | None = None  # the flag's help; None: a job key only
    column: bool = False
    record: Record = Record.NEVER
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    schema: Mapping[str, Any] = field(default_factory=dict)  # enum, pattern, minLength, ...
    unset: str | None = None  # what an unset (None) value means, for --help
    metavar: str | None = None
    negatable: bool = True  # a boolean flag has its --no- form
    flag_choices: bool = False  # the flag offers the schema's enum as click choices
    key: str | None = None  # the job key and flag, when not the field's name
    at_most: str | None = None  # another option of the part whose value bounds this one's
    note: str | None = None  # said after the rule where it is stated: top_k's "(0 = off)"

    def bounds(self) -> tuple[float, float]:
        """(low, high), unbounded ends as -inf/inf."""
        low = self.low if self.low is not None else float("-inf")
        return low, self.high if self.high is not None else float("inf")


def option(default: Any = dataclasses.MISSING, **declaration: Any) -> Any:
    """A dataclass field declared as an option (its default, then Option's fields)."""
    return field(default=default, metadata={"option": Option(**declaration)})


def declared(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Option]]:
    """The option fields of a dataclass, in field order."""
    for item in dataclasses.fields(cls):
        if "option" in item.metadata:
            yield item, item.metadata["option"]


def key_of(item: dataclasses.Field[Any], spec: Option) -> str:
    """The job key (and, dashed, the flag) of a declared field."""
    return spec.key or item.name
