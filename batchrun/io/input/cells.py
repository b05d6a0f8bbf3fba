"""Arrow cells to Python values, so that a cell that cannot be read spoils only its own row.

A column converts in one call; only when that fails (a string that is not valid UTF-8, a
timestamp outside Python's range) is it read again cell by cell, each bad cell becoming a BadCell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class BadCell:
    """A cell with no Python value; `reason` completes "<column> ...", e.g. "is not valid UTF-8"."""

    reason: str

    def __repr__(self) -> str:  # how logs show it, e.g. as a row's id
        return f"<{self.reason}>"


def row_values(batch: pa.RecordBatch, columns: Sequence[str]) -> list[dict[str, Any]]:
    """One {column: value} dict per row of `batch`, over the given columns."""
    by_column = {name: column_values(batch.column(name)) for name in columns}
    return [{name: values[i] for name, values in by_column.items()} for i in range(batch.num_rows)]


def column_values(array: pa.Array) -> list[Any]:
    try:
        return array.to_pylist()
    except Exception:  # some cell cannot be read: find which, and keep the others
        return [_cell_value(array, i) for i in range(len(array))]


def _cell_value(array: pa.Array, i: int) -> Any:
    try:
        return array[i].as_py()
    except UnicodeDecodeError:
        return BadCell("is not valid UTF-8")
    except Exception as exc:
        return BadCell(f"cannot be read: {exc}")


def without_nulls(value: Any) -> Any:
    """A struct cell's value with its null fields left out, at every depth (a struct column's
    row has every field of the type: those it does not set are null); a list keeps its nulls."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value
