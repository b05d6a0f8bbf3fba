"""Input cells that are not valid UTF-8: every string of every part is valid UTF-8 (polars and a
fully validating pyarrow read it), a replaced cell holds its bytes decoded with U+FFFD, its row's
`error` says so, and `<column>__raw_bytes` keeps the original bytes; an input whose strings are
all valid gives parts with the job's schema, unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from batchrun.cli import cli
from batchrun.errors import JobError
from batchrun.io.output.columns import (
    REPLACED_NOTE,
    OutputRow,
    build_table,
    concat_parts,
    conform_part,
    error_row,
    holds_strings,
    output_schema,
    raw_bytes_name,
    raw_bytes_type,
    replace_invalid_utf8,
)
from tests.io.test_fuzz_inputs import holds_invalid

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

BAD = [b"\xff\xfe", b"ok\xc3(", b"\xed\xa0\x80", b"caf\xc3\xa9\x80"]  # invalid, each its own way


def replaced(value: Any) -> Any:
    """What the output holds for an input value read as bytes: each bytes decoded with U+FFFD
    replacements (tuples are a map's entries)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list):
        return [replaced(v) for v in value]
    if isinstance(value, tuple):
        return tuple(replaced(v) for v in value)
    if isinstance(value, dict):
        return {k: replaced(v) for k, v in value.items()}
    return value


is_bad = holds_invalid  # a value (bytes, or bytes nested in lists and dicts) not valid UTF-8


def unchecked(values: list[Any], raw_type: pa.DataType, arrow_type: pa.DataType) -> pa.Array:
    """An array of `arrow_type` built from bytes without checking them."""
    return pa.array(values, raw_type).cast(arrow_type, safe=False)


def ok_row(row_index: int) -> OutputRow:
    """A generated row's output columns (their values do not matter here)."""
    return dataclasses.replace(error_row(row_index, "x"), finish_reason="length", error=None)


def note(*columns: str) -> str:
    raws = ", ".join(raw_bytes_name(c) for c in columns)
    return f"{REPLACED_NOTE}: {', '.join(columns)} (original bytes in {raws})"


def full_check(table: pa.Table) -> None:
    table.validate(full=True)  # raises on any invalid UTF-8


def read_both(path: Path) -> pa.Table:
    """The part as pyarrow reads it (fully validated); polars reads it too, with the same
    strings."""
    table = pq.read_table(path)
    full_check(table)
    frame = pl.read_parquet(path)
    for name in table.column_names:
        if pa.types.is_string(table.schema.field(name).type):
            assert frame[name].to_list() == table.column(name).to_pylist(), name
    return table


# One case per kind of column: its type, the type its cells are written from (bytes in place of
# strings), and its cells (None: a null cell).
STRUCT = pa.struct([("a", pa.string()), ("n", pa.int64()), ("b", pa.large_string())])
RAW_STRUCT = pa.struct([("a", pa.binary()), ("n", pa.int64()), ("b", pa.large_binary())])
CHAT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
RAW_CHAT = pa.list_(pa.struct([("role", pa.binary()), ("content", pa.binary())]))
CASES: list[tuple[str, pa.DataType, pa.DataType, list[Any]]] = [
    ("string", pa.string(), pa.binary(), [BAD[0], None, b"fine", BAD[1], b"", BAD[2]]),
    ("large", pa.large_string(), pa.large_binary(), [b"a", BAD[3], None, BAD[0], b"z", b"y"]),
    ("view", pa.string_view(), pa.binary(), [BAD[1], b"x", None, b"ok", b"", BAD[0]]),
    (
        "tags",
        pa.list_(pa.string()),
        pa.list_(pa.binary()),
        [[b"a", BAD[0]], None, [], [b"b", None], [BAD[2]], [b"c"]],
    ),
    (
        "big_tags",
        pa.large_list(pa.large_string()),
        pa.large_list(pa.large_binary()),
        [None, [b"a"], [BAD[1], BAD[3]], [], [b"x", b"y"], [None, BAD[0]]],
    ),
    (
        "pair",
        pa.list_(pa.string(), 2),
        pa.list_(pa.binary(), 2),
        [[b"a", b"b"], [BAD[0], b"c"], None, [b"d", None], [b"e", BAD[1]], [b"f", b"g"]],
    ),
    (
        "meta",
        STRUCT,
        RAW_STRUCT,
        [
            {"a": b"x", "n": 1, "b": BAD[0]},
            None,
            {"a": BAD[1], "n": None, "b": None},
            {"a": b"ok", "n": 3, "b": b"fine"},
            {"a": None, "n": 4, "b": b""},
            {"a": BAD[2], "n": 5, "b": BAD[3]},
        ],
    ),
    (
        "attrs",
        pa.map_(pa.string(), pa.string()),
        pa.map_(pa.binary(), pa.binary()),
        [
            [(b"k", BAD[0])],
            [(BAD[1], b"v")],
            None,
            [(b"k", b"v"), (b"k2", None)],
            [],
            [(b"a", b"b")],
        ],
    ),
    (
        "chat",
        CHAT,
        RAW_CHAT,
        [
            [{"role": b"user", "content": b"hi"}],
            [{"role": b"user", "content": BAD[0]}, {"role": b"system", "content": b"x"}],
            None,
            [{"role": BAD[3], "content": None}],
            [],
            [{"role": b"user", "content": b"fine"}],
        ],
    ),
]


def dictionary_column() -> tuple[pa.Array, list[Any]]:
    """A dictionary<string> column (as pandas categoricals are written): rows 0 and 3 use the
    invalid entry, row 2 is null."""
    dictionary = unchecked([b"fine", BAD[0], b"also"], pa.binary(), pa.string())
    indices = pa.array([1, 0, None, 1, 2, 0], pa.int32())
    return pa.DictionaryArray.from_arrays(indices, dictionary), [
        BAD[0],
        b"fine",
        None,
        BAD[0],
        b"also",
        b"fine",
    ]


def case_table() -> tuple[pa.Table, dict[str, list[Any]]]:
    """The cases as one input table, and each column's cells as bytes."""
    columns = {name: unchecked(cells, raw, t) for name, t, raw, cells in CASES}
    columns["dict"], dict_cells = dictionary_column()
    columns["number"] = pa.array(range(6), pa.int64())
    columns["blob"] = pa.array([BAD[0]] * 6, pa.binary())  # bytes, not strings: kept as they are
    cells = {name: values for name, _, _, values in CASES} | {"dict": dict_cells}
    return pa.table(columns), cells


def test_every_kind_of_string_column_is_replaced_and_its_bytes_kept(tmp_path: Path) -> None:
    inputs, cells = case_table()
    schema = output_schema(inputs.schema)
    rows = [error_row(i, "prompt is empty") if i == 1 else ok_row(i) for i in range(6)]
    # One-row slices, as a run passes them: the columns are built from sliced arrays.
    table = build_table(schema, inputs.to_batches(max_chunksize=1), rows)
    full_check(table)
    assert table.schema.names[: len(schema)] == schema.names
    for field in schema:
        assert table.schema.field(field.name).type == field.type, field.name
    raw_names = [n for n in table.column_names if n not in schema.names]
    assert raw_names == [raw_bytes_name(name) for name in cells]  # input order, all replaced
    for name, values in cells.items():
        assert table.column(name).to_pylist() == [replaced(v) for v in values], name
        raw = table.column(raw_bytes_name(name))
        assert raw.type == raw_bytes_type(schema.field(name).type)
        assert raw.to_pylist() == [v if is_bad(v) else None for v in values], name
        field = table.schema.field(raw_bytes_name(name))
        assert field.nullable and b"U+FFFD" in field.metadata[b"description"]
    assert table.column("blob").to_pylist() == [BAD[0]] * 6
    assert table.column("number").to_pylist() == list(range(6))
    for row, error in enumerate(table.column("error").to_pylist()):
        bad_columns = [name for name, values in cells.items() if is_bad(values[row])]
        expected = note(*bad_columns) if bad_columns else None
        if row == 1:
            expected = "prompt is empty" + (f"; {expected}" if expected else "")
        assert error == expected, row
    pq.write_table(table, tmp_path / "part.parquet")
    read_both(tmp_path / "part.parquet")


def test_all_valid_strings_keep_the_table_and_its_schema() -> None:
    inputs = pa.table(
        {
            "prompt": pa.array(["a", None, "é€😀"], pa.string()),
            "tags": pa.array([["x"], None, []], pa.list_(pa.string())),
            "meta": pa.array([{"a": "b"}, None, {"a": None}], pa.struct([("a", pa.string())])),
        }
    )
    schema = output_schema(inputs.schema)
    rows = [error_row(i, "x") for i in range(3)]
    table = build_table(schema, inputs.to_batches(max_chunksize=1), rows)
    assert table.schema.equals(schema, check_metadata=True)
    assert replace_invalid_utf8(table) is table
    assert table.column("error").to_pylist() == ["x"] * 3


def test_invalid_bytes_under_a_null_list_are_dropped_without_a_raw_column() -> None:
    # A null list whose (hidden) child string is invalid: the value is null, nobody's data is
    # lost, but the child must still be made valid for validating readers.
    values = unchecked([BAD[0], b"ok"], pa.binary(), pa.string())
    offsets = pa.array([0, 1, 2], pa.int32())
    hidden = pa.ListArray.from_arrays(offsets, values, mask=pa.array([True, False]))
    with pytest.raises(pa.ArrowInvalid):
        hidden.validate(full=True)
    schema = output_schema(pa.schema([("tags", hidden.type)]))
    table = build_table(
        schema, [pa.record_batch([hidden], names=["tags"])], [error_row(0, "x")] * 2
    )
    full_check(table)
    assert table.schema.equals(schema) and table.column("tags").to_pylist() == [None, ["ok"]]
    assert table.column("error").to_pylist() == ["x", "x"]


def test_holds_strings_and_raw_bytes_types() -> None:
    assert holds_strings(CHAT) and holds_strings(STRUCT)
    assert holds_strings(pa.dictionary(pa.int8(), pa.large_string()))
    assert not holds_strings(pa.binary()) and not holds_strings(pa.list_(pa.int64()))
    assert raw_bytes_type(CHAT) == RAW_CHAT
    assert raw_bytes_type(pa.dictionary(pa.int8(), pa.string())) == pa.binary()
    assert raw_bytes_type(pa.list_(pa.field("element", pa.string()))) == pa.list_(
        pa.field("element", pa.binary())
    )


def test_a_json_extension_column_is_replaced_in_its_storage() -> None:
    storage = unchecked([b'{"a": "\xff"}', b"{}"], pa.binary(), pa.string())
    column = pa.ExtensionArray.from_storage(pa.json_(), storage)
    schema = output_schema(pa.schema([("doc", column.type)]))
    table = build_table(schema, [pa.record_batch([column], ["doc"])], [ok_row(0), ok_row(1)])
    full_check(table)
    assert table.schema.field("doc").type == pa.json_()
    assert table.column("doc").combine_chunks().storage.to_pylist() == ['{"a": "\ufffd"}', "{}"]
    assert table.column(raw_bytes_name("doc")).to_pylist() == [b'{"a": "\xff"}', None]
    assert table.column("error").to_pylist() == [note("doc"), None]


def test_an_input_column_named_like_a_raw_bytes_column_is_refused() -> None:
    with pytest.raises(JobError, match="note__raw_bytes"):
        output_schema(pa.schema([("note", pa.string()), ("note__raw_bytes", pa.binary())]))
    # Not a string column: no raw-bytes column can ever be made for it, so no clash.
    output_schema(pa.schema([("n", pa.int64()), ("n__raw_bytes", pa.binary())]))


def test_parts_with_and_without_raw_columns_concatenate() -> None:
    schema = output_schema(pa.schema([("note", pa.string())]))
    bad = build_table(
        schema,
        [pa.record_batch([unchecked([BAD[0]], pa.binary(), pa.string())], ["note"])],
        [error_row(0, "x")],
    )
    good = build_table(
        schema, [pa.record_batch([pa.array(["fine"])], ["note"])], [error_row(1, "y")]
    )
    part = concat_parts([conform_part(good, schema), conform_part(bad, schema)])
    full_check(part)
    assert part.column("note").to_pylist() == ["fine", "\ufffd\ufffd"]
    assert part.column(raw_bytes_name("note")).to_pylist() == [None, BAD[0]]
    assert part.schema.names == [*schema.names, raw_bytes_name("note")]


# Whole jobs through the command line.


def write_job(tmp_path: Path, model: Path, **keys: Any) -> Path:
    settings = {"max_tokens": 3, "max_batch_size": 4, "rows_per_part": 100, **keys}
    job = tmp_path / "job.toml"
    job.write_text(
        f'input = "in"\noutput = "out"\ntarget = "{model}"\nquiet = true\n'
        + "".join(f"{key} = {value}\n" for key, value in settings.items())
    )
    return job


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


ROWS = 9


def hostile_input() -> tuple[pa.Table, dict[str, list[Any]]]:
    """Invalid UTF-8 in the first row, the last row, every row, and next to nulls, in several
    string columns (the prompt among them), as the bytes of each cell."""
    prompts = [b"def f(x):"] * ROWS
    prompts[0], prompts[4] = BAD[0], BAD[1]
    cells: dict[str, list[Any]] = {
        "prompt": prompts,
        "first": [BAD[2]] + [b"fine"] * (ROWS - 1),
        "last": [b"fine"] * (ROWS - 1) + [BAD[3]],
        "every": [BAD[i % len(BAD)] for i in range(ROWS)],
        "nulls": [None, BAD[0], None, b"ok", BAD[1], None, None, BAD[2], None],
        "valid": [b"caf\xc3\xa9", None] * 4 + [b"x"],
        "tags": [[b"a", BAD[0]], None, [], [b"b"], [None, BAD[1]], [b"c"], None, [b"d"], [BAD[2]]],
    }
    types = {
        "last": (pa.large_binary(), pa.large_string()),
        "tags": (pa.list_(pa.binary()), pa.list_(pa.string())),
    }
    columns = {
        name: unchecked(values, *types.get(name, (pa.binary(), pa.string())))
        for name, values in cells.items()
    }
    columns["number"] = pa.array(range(ROWS), pa.int64())
    return pa.table(columns), cells


def expected_error(row: int, cells: dict[str, list[Any]]) -> str:
    bad = [name for name, values in cells.items() if is_bad(values[row])]
    return ("prompt is not valid UTF-8; " if is_bad(cells["prompt"][row]) else "") + note(*bad)


@pytest.mark.parametrize("rows_per_part", [100, 2])
def test_a_job_with_invalid_utf8_writes_parts_every_reader_reads(
    tmp_path: Path, tiny_model: Path, rows_per_part: int
) -> None:
    table, cells = hostile_input()
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "rows.parquet", row_group_size=4)
    result = invoke("run", str(write_job(tmp_path, tiny_model, rows_per_part=rows_per_part)))
    assert result.exit_code == 0, (result.output, result.exception)
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(parts) == 1 if rows_per_part == 100 else len(parts) > 2
    tables = [read_both(part) for part in parts]
    out = concat_parts(tables).sort_by("row_index")
    full_check(out)
    assert out.column("number").to_pylist() == list(range(ROWS))
    for name, values in cells.items():
        assert out.column(name).to_pylist() == [replaced(v) for v in values], name
    for name in ("prompt", "first", "last", "every", "nulls", "tags"):
        raw = out.column(raw_bytes_name(name)).to_pylist()
        assert raw == [v if is_bad(v) else None for v in cells[name]], name
    assert raw_bytes_name("valid") not in out.column_names
    rows = out.to_pylist()
    for row in rows:
        assert row["error"] == expected_error(row["row_index"], cells)
        if is_bad(cells["prompt"][row["row_index"]]):
            assert row["finish_reason"] == "error" and row["completion"] is None
        else:  # generated as usual: only the note in `error` tells of the replacement
            assert row["finish_reason"] in ("stop", "length") and row["completion_tokens"] >= 1
    assert rows[0]["prompt"] == "\ufffd\ufffd" and rows[4]["prompt"] == "ok\ufffd("
    # Every part reads with polars at once, the parts' raw-bytes columns side by side.
    frame = pl.concat([pl.read_parquet(p) for p in parts], how="diagonal_relaxed").sort("row_index")
    assert frame["every"].to_list() == [replaced(v) for v in cells["every"]]
    assert frame[raw_bytes_name("every")].to_list() == cells["every"]
    stats = invoke("stats", str(tmp_path / "out"))
    if rows_per_part == 100:  # one part (see the test below for several)
        assert stats.exit_code == 0, stats.output
        assert f"rows: {ROWS} (7 ok, 2 errors)" in stats.output
        assert REPLACED_NOTE in stats.output


def test_stats_reads_parts_with_and_without_raw_bytes_columns(
    tmp_path: Path, tiny_model: Path
) -> None:
    table = pa.table(
        {
            "prompt": pa.array(["def f(x):"] * 4),
            "note": unchecked([b"ok", b"ok", b"ok", BAD[0]], pa.binary(), pa.string()),
        }
    )
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "rows.parquet")
    result = invoke("run", str(write_job(tmp_path, tiny_model, rows_per_part=2, max_batch_size=1)))
    assert result.exit_code == 0, (result.output, result.exception)
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert [raw_bytes_name("note") in pq.read_schema(p).names for p in parts] == [False, True]
    stats = invoke("stats", str(tmp_path / "out"))
    assert stats.exit_code == 0, (stats.output, stats.exception)
    assert "rows: 4 (4 ok, 0 errors)" in stats.output


def test_a_job_with_valid_strings_keeps_the_output_schema(tmp_path: Path, tiny_model: Path) -> None:
    table = pa.table(
        {
            "prompt": pa.array(["def f(x):", "import os", "é€😀"], pa.large_string()),
            "tags": pa.array([["a"], None, ["é"]], pa.list_(pa.string())),
        }
    )
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "rows.parquet")
    assert invoke("run", str(write_job(tmp_path, tiny_model))).exit_code == 0
    (part,) = sorted((tmp_path / "out").glob("part-*.parquet"))
    read = read_both(part)
    assert read.schema.equals(output_schema(table.schema), check_metadata=False)
    assert read.column("error").null_count == 3


def test_the_ray_path_writes_valid_utf8_and_keeps_the_bytes(
    tmp_path: Path, tiny_model: Path
) -> None:
    """BatchrunProcessor's batches, then the driver's commits (what `--ray` runs, without Ray)."""
    from batchrun.config.job import JobSpec
    from batchrun.io.output.stats import RunClock
    from batchrun.runners.opened_job import open_job
    from batchrun.runners.ray import BatchrunProcessor
    from batchrun.runners.ray.committer import commit_outputs
    from batchrun.runners.ray.processor import processor_settings
    from batchrun.runners.ray.run import preflight_info

    table, cells = hostile_input()
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "rows.parquet")
    job = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(tiny_model),
            max_tokens=3,
            max_batch_size=2,
            rows_per_part=4,
            quiet=True,
        )
    )
    processor = BatchrunProcessor(**processor_settings(job))
    with_index = table.append_column("row_index", pa.array(range(ROWS), pa.int64()))
    batches = [processor(with_index.slice(start, 4)) for start in range(0, ROWS, 4)]
    for batch in batches:  # what a user's Ray Data pipeline writes is valid too
        full_check(batch)
    processed = concat_parts(batches).sort_by("row_index")
    for name in ("prompt", "every", "tags"):
        raw = processed.column(raw_bytes_name(name)).to_pylist()
        assert raw == [v if is_bad(v) else None for v in cells[name]], name

    def outputs(done: Any) -> list[pa.Table]:
        assert not done.any()
        return batches

    opened = open_job(job)
    commit_outputs(opened, preflight_info(job, opened.prompt), RunClock(), outputs)
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    out = concat_parts([read_both(part) for part in parts]).sort_by("row_index")
    for name, values in cells.items():
        assert out.column(name).to_pylist() == [replaced(v) for v in values], name
    for row in out.to_pylist():
        assert row["error"] == expected_error(row["row_index"], cells)
    for name in ("prompt", "first", "last", "every", "nulls", "tags"):
        raw = out.column(raw_bytes_name(name)).to_pylist()
        assert raw == [v if is_bad(v) else None for v in cells[name]], name
