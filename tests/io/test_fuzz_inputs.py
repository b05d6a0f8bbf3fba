"""Fuzzed inputs through `batchrun run`: whatever the cells hold, the job ends with exit 0 and
each input row's output rows (one, or its `n` when that is valid), with `error` set exactly on
the rows that finished "error" and on those with an input cell that is not valid UTF-8 (which
polars and a fully validating pyarrow still read: such a cell is written with U+FFFD
replacements, its bytes in `<column>__raw_bytes`).

Each case draws, from its own seed, a prompt column (text, chat or token ids) and every override
column with a random Arrow type (integers of every width and sign, half to double floats,
strings, lists, bools, all-null), filled with extreme numbers, nulls, invalid UTF-8, empty strings
and empty lists, plus pass-through columns holding the same kinds of bytes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.io.input.cells import column_values
from batchrun.io.input.overrides import OVERRIDE_COLUMNS
from batchrun.io.input.prompts import CONSTRAINT_COLUMNS
from batchrun.io.output.columns import (
    REPLACED_NOTE,
    holds_strings,
    raw_bytes_name,
    raw_bytes_type,
)
from batchrun.sampling.params import MAX_SAMPLES

CONTEXT = 32  # the tiny model's context: long prompts and huge max_tokens reach it at once

INT_TYPES = [
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.uint16(),
    pa.uint32(),
    pa.uint64(),
]
FLOAT_TYPES = [pa.float16(), pa.float32(), pa.float64()]
STRING_TYPES = [pa.string(), pa.large_string()]
LIST_TYPES = [
    pa.list_(pa.int64()),
    pa.list_(pa.uint64()),
    pa.list_(pa.int8()),
    pa.list_(pa.float64()),
    pa.list_(pa.string()),
    pa.large_list(pa.large_string()),
]
OTHER_TYPES = [pa.bool_(), pa.null()]
CELL_TYPES = INT_TYPES + FLOAT_TYPES + STRING_TYPES + LIST_TYPES + OTHER_TYPES

INTS = [0, 1, 2, 3, 5, 7, 40, -1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1]
FLOATS = [
    *(math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-40, 1e-6, 1e-5),
    *(0.5, 0.9, 1.0, 1.5, 3.0, 1e39, 2.0**63, 2.0**64, -(2.0**63), -1.0),
]
BYTES = [b"", b"\xff\xfe", b"\xc3(", b"\xed\xa0\x80", b"\n", b"ok", b"0.5", b"12", "é€😀".encode()]
TEXTS = [
    b"def f(x):",
    b"import os\n",
    b"class A:\n    pass",
    "caf\u00e9 \u2603 \U0001f600".encode(),
    b"<|im_start|>user\nhi<|im_end|>",
    b"x " * 60,  # tokenized, then too long
    b"a" * 5000,  # too long by the bound alone
    b"",
    b"\xff\xfe",
    b"ok\xc3(",
]


# Per override column: the Arrow types a user would likely write (wide ones, which hold the
# extremes, more often), and values that run.
WIDE_INTS = [pa.uint64(), pa.int64(), pa.float64()]
FITTING_TYPES = {
    "max_tokens": WIDE_INTS + [pa.int8(), pa.uint32()],
    "temperature": FLOAT_TYPES + [pa.float64(), pa.int64()],
    "top_p": FLOAT_TYPES + [pa.float64()],
    "top_k": WIDE_INTS + [pa.int16(), pa.uint8()],
    "seed": WIDE_INTS + [pa.int32(), pa.uint16()],
    "stop": [pa.list_(pa.string()), pa.large_list(pa.large_string())],
    "stop_token_ids": [pa.list_(pa.int64()), pa.list_(pa.uint64()), pa.list_(pa.int8())],
    "n": WIDE_INTS + [pa.int8(), pa.uint16()],
    "ignore_eos": [pa.bool_()],
    "max_thinking_tokens": WIDE_INTS + [pa.int16()],
    "presence_penalty": FLOAT_TYPES + [pa.float64(), pa.int64()],
    "frequency_penalty": FLOAT_TYPES + [pa.float64(), pa.int8()],
    "repetition_penalty": FLOAT_TYPES + [pa.float64()],
    "min_tokens": WIDE_INTS + [pa.int16()],
    "logit_bias": [pa.string(), pa.large_string()],
    "min_p": FLOAT_TYPES + [pa.float64()],
    "json_schema": STRING_TYPES,
    "regex": STRING_TYPES,
    "choice": [pa.list_(pa.string()), pa.large_list(pa.string())],
}
SANE: dict[str, list[Any]] = {
    "max_tokens": [1, 2, 3, 2**63, 2**64 - 1],
    "temperature": [0.0, 0.5, 1.0, 1e-6, 5e-324],
    "top_p": [1.0, 0.9, 0.5, 1e-40],
    "top_k": [0, 1, 5, 2**63, 2**64 - 1],
    "seed": [0, 1, -1, 2**63, 2**64 - 1, -(2**63)],
    "stop": [[], [b"\n"], [b"e", b"\xff"], [b"(", b"0"]],
    "stop_token_ids": [[], [3], [2**64 - 1], [0, 7]],
    "n": [1, 2, 3, MAX_SAMPLES + 1],
    "ignore_eos": [True, False],
    "max_thinking_tokens": [0, 1, 5],
    "presence_penalty": [0.0, 1.5, -2.0, 2.0],
    "frequency_penalty": [0.0, 0.5, -1.0],
    "repetition_penalty": [1.0, 1.3, 0.5, 1e-30],
    "min_tokens": [0, 1, 3],
    "logit_bias": [b"{}", b'{"3": 5}', b'{"0": -100, "7": 100.0}', b'{"99999999": 1}'],
    "min_p": [0.0, 0.1, 1.0],
    "json_schema": [b'{"type": "boolean"}', b'{"type": ', b'{"enum": ["a", 1]}', b"[]"],
    "regex": [b"[a-z]+", b"(x", b"a|b\\d", b""],
    "choice": [[b"yes", b"no"], [], [b""], [b"\xff"]],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def strings(cells: list[bytes | None], arrow_type: pa.DataType) -> pa.Array:
    """Strings written from raw bytes, unchecked: some are not valid UTF-8."""
    return pa.array(cells, pa.binary()).cast(arrow_type, safe=False)


def clipped_ints(arrow_type: pa.DataType) -> list[int]:
    info = np.iinfo(arrow_type.to_pandas_dtype())
    return [v for v in INTS if info.min <= v <= info.max] + [int(info.min), int(info.max)]


def override_cells(rng: random.Random, name: str, rows: int, hostile: bool) -> pa.Array:
    """An override column: in a hostile case of any type, else of a fitting type, its cells
    mostly values that run (extreme ones among them)."""
    if hostile:
        return random_cells(rng, rng.choice(CELL_TYPES), rows)
    return random_cells(rng, rng.choice(FITTING_TYPES[name]), rows, SANE[name])


def random_cells(
    rng: random.Random, arrow_type: pa.DataType, rows: int, sane: Sequence[Any] = ()
) -> pa.Array:
    """`rows` cells of the type: nulls (about one in three), else one of `sane`
    (where it fits the type) mostly, else extreme values, invalid UTF-8, empty strings and lists."""
    present = [rng.random() > 1 / 3 for _ in range(rows)]
    if pa.types.is_null(arrow_type):
        return pa.nulls(rows)
    if pa.types.is_boolean(arrow_type):
        return pa.array([rng.random() < 0.5 if p else None for p in present], arrow_type)
    if pa.types.is_integer(arrow_type):
        ints = clipped_ints(arrow_type)
        fit_ints = [v for v in sane if isinstance(v, int) and min(ints) <= v <= max(ints)]
        return pa.array([pick(rng, fit_ints, ints) if p else None for p in present], arrow_type)
    if pa.types.is_floating(arrow_type):
        fit_floats = [float(v) for v in sane if isinstance(v, (int, float))]
        doubles = np.array([pick(rng, fit_floats, FLOATS) for _ in range(rows)])
        with np.errstate(over="ignore"):
            values = doubles.astype(arrow_type.to_pandas_dtype())
        return pa.array(values, arrow_type, mask=~np.array(present))
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        fit_bytes = [v for v in sane if isinstance(v, bytes)]
        return strings([pick(rng, fit_bytes, BYTES) if p else None for p in present], arrow_type)
    item = arrow_type.value_type
    raw = pa.binary() if pa.types.is_string(item) or pa.types.is_large_string(item) else item
    fit_lists = [v for v in sane if isinstance(v, list)]
    lists = [pick(rng, fit_lists, [random_list(rng, raw)]) if p else None for p in present]
    if pa.types.is_integer(raw):  # a sane id list may not fit a narrow item type
        ints = clipped_ints(raw)
        low, high = min(ints), max(ints)
        fits = [v is None or all(i is None or low <= i <= high for i in v) for v in lists]
        lists = [v if ok else [] for v, ok in zip(lists, fits, strict=True)]
    return pa.array(lists, pa.list_(raw)).cast(arrow_type, safe=False)


def pick(rng: random.Random, sane: Sequence[Any], extreme: Sequence[Any]) -> Any:
    return rng.choice(sane if sane and rng.random() < 0.85 else extreme)


def random_list(rng: random.Random, item: pa.DataType) -> list[Any]:
    if pa.types.is_integer(item):
        choices: list[Any] = clipped_ints(item)
    elif pa.types.is_floating(item):
        choices = FLOATS
    else:
        choices = BYTES
    return [rng.choice([*choices, None]) for _ in range(rng.choice([0, 1, 1, 2, 3]))]


def text_prompts(rng: random.Random, rows: int) -> pa.Array:
    arrow_type = rng.choice(STRING_TYPES)
    return strings([rng.choice([*TEXTS, None]) for _ in range(rows)], arrow_type)


def chat_prompts(rng: random.Random, rows: int) -> pa.Array:
    def message() -> dict[str, bytes | None]:
        return {"role": rng.choice([b"user", b"system", None, b"\xff"]), "content": text()}

    def text() -> bytes | None:
        return rng.choice([*TEXTS, None, b"hi"])

    chats = [rng.choice([None, [], [message()], [message(), message()]]) for _ in range(rows)]
    raw = pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())]))
    typed = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    return pa.array(chats, raw).cast(typed, safe=False)


def token_id_prompts(rng: random.Random, rows: int) -> pa.Array:
    arrow_type = rng.choice([pa.list_(pa.int64()), pa.list_(pa.uint64()), pa.list_(pa.int16())])
    ids = clipped_ints(arrow_type.value_type)
    lists = [
        rng.choice(
            [
                None,
                [],
                [None],
                [rng.choice(ids)],
                [rng.randrange(3, 500) for _ in range(rng.randrange(1, 8))],
                [5] * (CONTEXT + rng.randrange(0, 3)),
            ]
        )
        for _ in range(rows)
    ]
    return pa.array(lists, arrow_type)


PROMPTS: list[tuple[str, Callable[[random.Random, int], pa.Array]]] = [
    ("prompt", text_prompts),
    ("messages", chat_prompts),
    ("prompt_token_ids", token_id_prompts),
]


def fuzzed_table(seed: int) -> pa.Table:
    rng = random.Random(seed)
    rows = rng.randrange(40, 61)
    name, prompts = PROMPTS[seed % len(PROMPTS)]
    columns: dict[str, pa.Array] = {name: prompts(rng, rows)}
    hostile = seed % 2 == 1  # with the prompt kinds, seeds 0-5 (and 6-11) cover every pairing
    for override in OVERRIDE_COLUMNS:
        if not hostile or rng.random() < 0.7:
            columns[override] = override_cells(rng, override, rows, hostile)
    for constraint in CONSTRAINT_COLUMNS:  # fewer: a row with two of them is an error
        if rng.random() < 0.4:
            columns[constraint] = override_cells(rng, constraint, rows, hostile)
    columns["note"] = strings([rng.choice([*BYTES, None]) for _ in range(rows)], pa.string())
    columns["blob"] = pa.array([rng.choice(BYTES) for _ in range(rows)], pa.binary())
    columns["tags"] = random_cells(rng, pa.list_(pa.string()), rows)
    return pa.table(columns)


@pytest.mark.parametrize("seed", range(12))
def test_fuzzed_inputs_end_with_one_row_each(
    tmp_path: Path, make_model: Callable[..., Path], seed: int
) -> None:
    table = fuzzed_table(seed)
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "rows.parquet", row_group_size=17)
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{make_model(max_position_embeddings=CONTEXT)}"\n'
        f'id_column = "note"\nmax_tokens = {2 + seed % 3}\ntemperature = {0.7 * (seed // 2 % 2)}\n'
        f"max_batch_size = 16\nrows_per_part = 20\nseed = {seed}\n"
    )
    result = CliRunner().invoke(cli, ["run", str(job)])
    assert result.exit_code == 0, (result.output, result.exception)

    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    order = [("row_index", "ascending"), ("sample_index", "ascending")]
    for part in parts:  # every reader reads every part: its strings are valid UTF-8
        pq.read_table(part).validate(full=True)
        pl.read_parquet(part)
    out = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="default").sort_by(
        order
    )
    cells = column_values(table.column("n")) if "n" in table.column_names else [None] * len(table)
    rows = [row for row, cell in enumerate(cells) for _ in range(output_rows(cell))]
    assert out.column("row_index").to_pylist() == rows
    bad = {name: invalid_cells(table.column(name)) for name in table.column_names}
    errors, reasons = out.column("error").to_pylist(), out.column("finish_reason").to_pylist()
    for i, (row, error, reason) in enumerate(zip(rows, errors, reasons, strict=True)):
        replaced = [name for name in table.column_names if bad[name][row]]
        if not replaced:
            assert (error is not None) == (reason == "error"), i
            assert error is None or REPLACED_NOTE not in error, i
            continue
        raws = ", ".join(raw_bytes_name(name) for name in replaced)
        note = f"{REPLACED_NOTE}: {', '.join(replaced)} (original bytes in {raws})"
        assert error == note if reason != "error" else error.endswith(f"; {note}"), i
    assert out.column("blob").equals(table.column("blob").take(rows))  # binary: byte for byte
    strings = [name for name in table.column_names if holds_strings(table.column(name).type)]
    for name in strings:  # valid cells come back byte for byte, the others replaced
        original = table.column(name).take(rows)
        if not any(bad[name]):
            assert out.column(name).equals(original), name
            assert raw_bytes_name(name) not in out.column_names, name
            continue
        raw = out.column(raw_bytes_name(name)).to_pylist()
        raw_original = as_bytes(original).to_pylist()
        assert raw == [
            v if bad[name][r] else None for v, r in zip(raw_original, rows, strict=True)
        ], name
        got = as_bytes(out.column(name)).to_pylist()
        assert got == [replaced_value(v) for v in raw_original], name


def as_bytes(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The column with bytes in place of its strings (dictionaries decoded)."""
    return column.cast(raw_bytes_type(column.type))


def invalid_cells(column: pa.ChunkedArray) -> list[bool]:
    """Per cell: whether it holds a string that is not valid UTF-8."""
    if not holds_strings(column.type):
        return [False] * len(column)
    return [holds_invalid(value) for value in as_bytes(column).to_pylist()]


def holds_invalid(value: Any) -> bool:
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        return any(holds_invalid(v) for v in value)
    if isinstance(value, dict):
        return any(holds_invalid(v) for v in value.values())
    return False


def replaced_value(value: Any) -> Any:
    """A cell as bytes, as the output holds it: every bytes decoded with U+FFFD replacements,
    then encoded again."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").encode()
    if isinstance(value, list):
        return [replaced_value(v) for v in value]
    if isinstance(value, dict):
        return {k: replaced_value(v) for k, v in value.items()}
    return value


def output_rows(n: Any) -> int:
    """A row's output rows: its n when that is an integer (or integral float) in [1,
    MAX_SAMPLES], else 1 (the job's n, or the one error row saying the n is bad)."""
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return 1
    if isinstance(n, float) and not n.is_integer():
        return 1
    return int(n) if 1 <= n <= MAX_SAMPLES else 1
