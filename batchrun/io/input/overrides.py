"""Sampling parameters of one row: override cells to typed values, then what the engine runs.

The rules are SamplingParams.problem's, for a row's cells and the job's keys alike; what passes
them is normalised here into values the engine's tensors hold: a seed modulo 2^64, a top_k past
the vocabulary off, a temperature below GREEDY_BELOW greedy.
"""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from typing import Any

from batchrun.io.input.cells import BadCell
from batchrun.sampling.option import Kind, declared
from batchrun.sampling.params import SamplingParams


def override_kinds(params: type = SamplingParams) -> dict[str, Kind]:
    """The optional input columns whose non-null cells override the job's sampling defaults
    (the fields declared with column=True), each with the kind of value it takes."""
    return {item.name: spec.kind for item, spec in declared(params) if spec.column}


_COLUMN_KINDS = override_kinds()
OVERRIDE_COLUMNS = tuple(_COLUMN_KINDS)
# As in vLLM: below this, 1/T overflows float32 logits (or T is 0 or subnormal in float32).
GREEDY_BELOW = 1e-5


class BadOverride(ValueError):
    """An override cell of the wrong type; the message is the row's error."""


def for_engine(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Valid params (problem() is None) as the engine runs them; the same samples they mean."""
    return dataclasses.replace(
        params,
        temperature=0.0 if params.temperature < GREEDY_BELOW else params.temperature,
        top_k=0 if params.top_k >= vocab_size else params.top_k,
        seed=params.seed % (1 << 64),
    )


def output_rows(n_cell: Any, job_n: int) -> int:
    """How many output rows an input row makes, whatever else is wrong with it: its n (the
    `n` cell, or the job's when null), or 1 when that n is itself invalid (the error row
    that says so)."""
    if n_cell is None:
        return job_n
    try:
        n = convert_override("n", n_cell)
    except BadOverride:
        return 1
    return n if SamplingParams(n=n).problem() is None else 1


def convert_override(name: str, value: Any) -> Any:
    """The cell as the type SamplingParams wants; BadOverride when it has the wrong type."""
    return convert_cell(_COLUMN_KINDS[name], name, value)


def convert_cell(kind: Kind, name: str, value: Any) -> Any:
    """A cell of column `name`, which takes values of this kind, as the type its field wants;
    BadOverride when it has the wrong type."""
    if isinstance(value, BadCell):
        raise BadOverride(f"{name} {value.reason}")
    if kind is Kind.INT:
        number = _as_int(value)
        if number is None:
            raise BadOverride(f"{name} must be an integer, got {show_value(value)}")
        return number
    if kind is Kind.FLOAT:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise BadOverride(f"{name} must be a number, got {show_value(value)}")
    if kind is Kind.BOOL:
        if isinstance(value, bool):
            return value
        raise BadOverride(f"{name} must be true or false, got {show_value(value)}")
    if kind is Kind.TOKEN_BIAS:
        return token_bias(name, value)
    if kind is Kind.STRINGS:
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise BadOverride(f"{name} must be a list of strings, got {show_value(value)}")
    if kind is not Kind.TOKEN_IDS:
        raise ValueError(f"no per-row column takes values of kind {kind.value}")
    ids = [_as_int(token) for token in value] if isinstance(value, list) else [None]
    if any(token is None for token in ids):
        raise BadOverride(f"{name} must be a list of integers, got {show_value(value)}")
    return tuple(ids)


def token_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    """A token-bias cell or job key `name`: a JSON object string of token id (a decimal
    string) -> number, or a struct (its fields null in this row left out), as sorted (id, bias)
    pairs; the range of each is SamplingParams.problem's."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadOverride(f"{name} is not JSON: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise BadOverride(f"{name} must be a JSON object, got {show_value(value)}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if bias is None:
            continue
        if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
            raise BadOverride(f"{name} keys must be token ids, got {show_value(key)}")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise BadOverride(f"{name} values must be numbers, got {show_value(bias)}")
        if int(key) in pairs:
            raise BadOverride(f"{name} names token id {int(key)} twice")
        pairs[int(key)] = bias  # its range is checked with the row's other parameters
    return tuple(sorted(pairs.items()))


def token_bias_keys(pairs: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """(id, bias) pairs as the job key writes them: token id (a decimal string) -> bias."""
    return {str(token): bias for token, bias in pairs}


def show_value(value: Any, limit: int = 100) -> str:
    """repr for an error message, cut short: a cell can be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_int(value: Any) -> int | None:
    # Integral floats are accepted: pandas stores an int column with nulls as float64. So are
    # integral decimals: a decimal128(20, 0) column is how SQL exports hold every seed in
    # [-2^63, 2^64), which no Arrow integer type does.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Decimal) and value.is_finite() and value == value.to_integral_value():
        return int(value)
    return None
