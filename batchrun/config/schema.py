"""The job file's JSON Schema, derived from the options' declarations (config/options.py)."""

from __future__ import annotations

from typing import Any

from batchrun.config.options import JobOption, job_options
from batchrun.sampling.option import Kind

# The JSON Schema of each kind, before its range and extra keywords.
_KIND_SCHEMA: dict[Kind, dict[str, Any]] = {
    Kind.INT: {"type": "integer"},
    Kind.FLOAT: {"type": "number"},
    Kind.BOOL: {"type": "boolean"},
    Kind.TEXT: {"type": "string"},
    Kind.STRINGS: {"type": "array", "items": {"type": "string", "minLength": 1}},
    Kind.TOKEN_IDS: {"type": "array", "items": {"type": "integer", "minimum": 0}},
    Kind.TOKEN_BIAS: {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}},
    Kind.OBJECT: {"type": "object"},
    Kind.SCHEMA: {},
}


def _range(low: float | None, high: float | None, low_open: bool) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    if low is not None:
        bounds["exclusiveMinimum" if low_open else "minimum"] = low
    if high is not None:
        bounds["maximum"] = high
    return bounds


def key_schema(option: JobOption) -> dict[str, Any]:
    """One job key's schema: its kind's, its extra keywords, its range, default, description."""
    spec = option.spec
    schema = dict(_KIND_SCHEMA[spec.kind]) | dict(spec.schema)
    bounds = _range(spec.low, spec.high, spec.low_open)
    if spec.kind is Kind.TOKEN_BIAS:  # the range bounds the biases, not the object
        schema["additionalProperties"] = {"type": "number", **bounds}
    else:
        schema |= bounds
    default = option.default
    if not option.required and default is not None and spec.kind is not Kind.TOKEN_BIAS:
        schema["default"] = list(default) if isinstance(default, tuple) else default
    return schema | {"description": spec.doc}


def job_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a job: the keys of a job file, which are also the CLI flags."""
    options = job_options()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://batchrun.dev/schemas/job.schema.json",
        "title": "batchrun job",
        "description": "A batchrun job file (TOML). Every key is also a command-line flag "
        "(underscores become dashes); flags override the file, the file overrides defaults. "
        "input, output and target are required, from the file or from flags.",
        "type": "object",
        "properties": {option.key: key_schema(option) for option in options},
        "required": [option.key for option in options if option.required],
        "additionalProperties": False,
    }
