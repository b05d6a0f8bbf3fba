"""A declared option's rule, from its kind and range (batchrun/sampling/option.py): whether a
value keeps it, and how a message or a table says it. The engine samples in float32, so a
number's rule holds for its float32 value too."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from batchrun.sampling.option import Kind, Option

# Integer bounds this far out read as powers of two: a seed is in [-2^63, 2^64).
_POWER_FROM = 1 << 32


def rule_problem(name: str, spec: Option, value: Any, bound: Any = None) -> str | None:
    """Why `value` breaks the rule declared for option `name`, or None. `bound` is the value
    of the option `spec.at_most` names. A None value is unset, where the option may be."""
    if value is None and spec.unset is not None:
        return None
    if spec.kind is Kind.INT:
        high = bound if spec.at_most is not None else spec.high
        if _integer(value) and _within_bounds(value, spec.low, high, spec.low_open):
            return None
        return f"{name} must be {requirement(spec)}, got {value!r}"
    if spec.kind is Kind.FLOAT:
        if number_keeps(spec, value):
            return None
        return f"{name} must be {requirement(spec)}, got {show(value)}"
    if spec.kind is Kind.BOOL:
        return (
            None if isinstance(value, bool) else f"{name} must be true or false, got {show(value)}"
        )
    if spec.kind is Kind.STRINGS:
        if all(isinstance(item, str) and item != "" for item in value):
            return None
        return f"{name} must be {requirement(spec)}"
    if spec.kind is Kind.TOKEN_IDS:
        if all(_integer(item) and item >= 0 for item in value):
            return None
        return f"{name} must be {requirement(spec)}"
    if spec.kind is Kind.TOKEN_BIAS:
        for token, bias in value:
            if not (_integer(token) and token >= 0):
                return f"{name} keys must be token ids (integers >= 0), got {token!r}"
            if not number_keeps(spec, bias):
                return f"{name} values must be numbers in {interval(spec)}, got {show(bias)}"
        return None
    return None  # text, objects and schemas: the job schema holds them to theirs


def number_keeps(spec: Option, value: Any) -> bool:
    """A finite number (not a bool) in the declared range, its float32 value too."""
    if not (_number(value) and _within_bounds(value, spec.low, spec.high, spec.low_open)):
        return False
    single = _float32(value)
    low_ok = spec.low is None or not spec.low_open or single > spec.low
    return math.isfinite(value) and math.isfinite(single) and low_ok


def requirement(spec: Option) -> str:
    """What a value must be, as a message says it: "an integer >= 1", "a number in [-2, 2]",
    "a finite number > 0", "in (0, 1]" (a half-open range reads as itself)."""
    note = f" {spec.note}" if spec.note else ""
    if spec.kind is Kind.INT:
        if spec.at_most is not None:
            return f"an integer in [{_bound(spec.low)}, {spec.at_most}]{note}"
        if spec.high is None:
            return f"an integer >= {_bound(spec.low)}{note}"
        return f"an integer in {interval(spec)}{note}"
    if spec.kind is Kind.FLOAT:
        if spec.high is None:
            return f"a finite number {'>' if spec.low_open else '>='} {_bound(spec.low)}{note}"
        if spec.low_open:
            return f"in {interval(spec)}{note}"
        return f"a number in {interval(spec)}{note}"
    if spec.kind is Kind.BOOL:
        return "true or false"
    if spec.kind is Kind.STRINGS:
        return "a list of non-empty strings"
    if spec.kind is Kind.TOKEN_IDS:
        return "a list of non-negative integers"
    if spec.kind is Kind.TOKEN_BIAS:
        return f"token id -> bias in {interval(spec)}"
    return "as the job schema says"


def interval(spec: Option) -> str:
    """The declared range as "[low, high]", "(low, high]", or "[low, 2^k)" for an integer
    whose end is a power of two far out."""
    opening = "(" if spec.low_open else "["
    high = spec.high
    if isinstance(high, int) and _power(high + 1):
        return f"{opening}{_bound(spec.low)}, {_bound(high + 1)})"
    return f"{opening}{_bound(spec.low)}, {_bound(high)}]"


def show(value: Any) -> str:
    """The value, with its float32 where that is what breaks the rule (0 or inf)."""
    single = _float32(value)
    if (single == 0 and value != 0) or (math.isinf(single) and not math.isinf(value)):
        return f"{value!r} ({single:g} in float32)"
    return repr(value)


def _bound(value: float | None) -> str:
    if isinstance(value, int) and _power(abs(value)):
        return f"{'-' if value < 0 else ''}2^{abs(value).bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _power(value: int) -> bool:
    return value >= _POWER_FROM and value & (value - 1) == 0


def _within_bounds(value: Any, low: float | None, high: float | None, low_open: bool) -> bool:
    # Compared as they are, not as floats: an integer may be beyond float range.
    if low is not None and (value <= low if low_open else value < low):
        return False
    return high is None or value <= high


def _float32(value: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
