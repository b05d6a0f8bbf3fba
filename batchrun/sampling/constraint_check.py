"""A finished row's text checked against its whole constraint without xgrammar: the second line
of defence, behind refusing what xgrammar does not enforce (json_schema_support.py).

A JSON Schema: the text parsed as JSON, then jsonschema's validator of the schema's draft, with
`pattern` read as ECMA-262 reads it (regex_dialect.py) and `format` an annotation (jsonschema's
default: the grammar holds the formats it knows). A regex: a match of the whole text, in
xgrammar's dialect. A choice: one of the strings, exactly.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

from batchrun.sampling.constraint import Constraint
from batchrun.sampling.json_schema_support import validator_class
from batchrun.sampling.regex_dialect import python_regex

_SHOWN = 200  # characters of a validator's message kept: it can quote the whole completion


def violation(constraint: Constraint, text: str) -> str | None:
    """Why `text` does not satisfy the constraint (it completes "the completion breaks its
    <kind>: "), or None: it does."""
    if constraint.kind == "choice":
        return None if text in constraint.value else f"{_cut(repr(text))} is not one of them"
    if constraint.kind == "regex":
        whole = python_regex(str(constraint.value), dot_all=True).fullmatch(text)
        return None if whole else "it does not match the whole text"
    return _schema_violation(str(constraint.value), text)


def _schema_violation(schema: str, text: str) -> str | None:
    try:
        instance = json.loads(text, parse_constant=_not_json)
    except ValueError as exc:
        return f"it is not JSON ({exc})"
    except RecursionError:
        return "it nests too deeply to be checked"
    try:
        error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(instance))
    except Exception as exc:  # (a recursion too deep, say): the row's error, not the job's
        return f"it could not be checked: {type(exc).__name__}: {_cut(str(exc))}"
    if error is None:
        return None
    where = "".join(f"/{step}" for step in error.absolute_path) or "the top"
    return f"{_cut(error.message)} (at {where})"


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


@functools.lru_cache(maxsize=64)
def _validator(schema: str) -> Validator:
    loaded = json.loads(schema)
    base = validator_class(loaded) or jsonschema.Draft202012Validator
    ecma: type[Validator] = jsonschema.validators.extend(base, {"pattern": _pattern})
    return ecma(loaded)


def _pattern(
    validator: Validator, pattern: str, instance: Any, schema: Any
) -> Iterator[jsonschema.ValidationError]:
    """JSON Schema's `pattern` in ECMA-262's dialect (jsonschema's own uses Python's)."""
    string = validator.is_type(instance, "string")
    if string and python_regex(pattern, dot_all=False).search(instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _cut(message: str) -> str:
    return message if len(message) <= _SHOWN else message[: _SHOWN - 3] + "..."
