"""Streaming Parquet input: a file, a directory or a glob, read in path order, batch by batch.
(An OpenAI Batch file, *.jsonl, reads the same way: batchrun/io/input/openai_batch.py.)

Memory does not grow with the input: only one record batch of one row group is decoded at a
time, and row groups whose rows are all skipped (other shards, already committed) are not read.
Each file's footer is read once, exactly (open_input), and kept: reading rows then fetches only
the column chunks of the row groups read, and a file none of whose rows are wanted is never
opened again. The files may be local or in object storage (s3://, gs://): they are
listed (batchrun.io.input.listing) and opened through their store (batchrun.io.store), read the
same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import JobError
from batchrun.io.input.listing import input_paths
from batchrun.io.input.openai_batch import (
    REQUEST_SCHEMA,
    RequestFileIndex,
    first_duplicate_id,
    index_request_file,
    is_request_file,
    read_request_rows,
)
from batchrun.io.store import LOCAL, ObjectLocation, Store, storage_reason

READ_BATCH_ROWS = 256  # small: a row's pass-through slice pins its batch until the row is written
_PARQUET_MAGIC = b"PAR1"


@dataclass(frozen=True)
class InputFile:
    path: PurePath  # in `store`: a Path locally, bucket/key in an object store
    first_row: int  # row_index of its first row
    row_group_rows: tuple[int, ...]
    footer_sha256: str = ""  # of its footer's bytes (the job fingerprint holds it)
    metadata: pq.FileMetaData | None = field(default=None, compare=False, repr=False)
    requests: RequestFileIndex | None = field(default=None, compare=False, repr=False)  # .jsonl
    store: Store = field(default=LOCAL, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows)

    @property
    def shown(self) -> str:
        """The file as the user names it: its path, or its URI."""
        return self.store.shown(self.path)

    @property
    def location(self) -> str:
        """What identifies the file in a job's fingerprint: its resolved path, or its URI."""
        return str(Path(self.path).resolve()) if self.store.local else self.shown


@dataclass(frozen=True)
class InputSource:
    files: tuple[InputFile, ...]
    schema: pa.Schema  # shared by every file, without schema metadata

    @property
    def total_rows(self) -> int:
        return sum(file.num_rows for file in self.files)


@dataclass(frozen=True)
class InputBatch:
    row_indices: np.ndarray  # int64, the global row_index of each row of `batch`
    batch: pa.RecordBatch


class RowSelection:
    """Which rows this run processes: its rows (a shard's range, or every row) that have no
    committed output yet."""

    def __init__(self, done: np.ndarray, rows: range | None = None) -> None:
        self.done = done
        self.rows = range(len(done)) if rows is None else rows

    def mask(self, start: int, stop: int) -> np.ndarray:
        wanted = ~self.done[start:stop]
        first = min(max(self.rows.start, start), stop) - start
        last = min(max(self.rows.stop, start), stop) - start
        wanted[:first] = False
        wanted[last:] = False
        return wanted

    def count(self) -> int:
        return int((~self.done[self.rows.start : self.rows.stop]).sum())


def open_input(spec: str, exclude: str | Path | None = None) -> InputSource:
    """Read the footers of every input file (no data) and check they share one schema.

    exclude: the output directory (a local path or an object-store URI), never read as input.
    """
    files: list[InputFile] = []
    schema: pa.Schema | None = None
    first_row = 0
    store, paths = input_paths(spec, exclude)
    for path in paths:
        if is_request_file(Path(path.name)) and not store.local:
            raise JobError(
                f"input file {store.shown(path)!r}: OpenAI Batch files are read from local "
                "paths only"
            )
        if is_request_file(Path(path)):
            file, file_schema = _open_request_file(Path(path), first_row), REQUEST_SCHEMA
            schema = schema or file_schema
            if not file_schema.equals(schema):
                raise JobError(f"input file {str(path)!r} is an OpenAI Batch file; the others not")
            files.append(file)
            first_row += file.num_rows
            continue
        shown = store.shown(path)
        try:
            footer = parquet_footer(path, store)
            parquet = pq.ParquetFile(pa.BufferReader(footer_file(footer)))
            metadata = parquet.metadata
            # schema_arrow restores the writer's Arrow types (large_string, time zones, ...).
            file_schema = parquet.schema_arrow.remove_metadata()
        except (OSError, pa.ArrowException) as exc:
            raise JobError(f"cannot read input file {shown!r}: {exc}") from exc
        duplicated = _duplicated_name(file_schema)
        if duplicated is not None:
            raise JobError(
                f"input file {shown!r} has the column {duplicated!r} more than once; "
                "batchrun needs distinct column names"
            )
        if schema is None:
            schema = file_schema
        elif not file_schema.equals(schema):
            raise JobError(
                f"input file {shown!r} has columns {_describe(file_schema)}, "
                f"but the first file has {_describe(schema)}"
            )
        rows = tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
        sha256 = hashlib.sha256(footer).hexdigest()
        files.append(InputFile(path, first_row, rows, sha256, metadata, store=store))
        first_row += sum(rows)
    assert schema is not None  # input_paths never returns an empty list
    _check_request_ids(files)
    return InputSource(files=tuple(files), schema=schema)


def _check_request_ids(files: Sequence[InputFile]) -> None:
    """Refuse request files whose lines repeat a custom_id (results are matched by it)."""
    requests = [(file.shown, Path(file.path)) for file in files if file.requests is not None]
    try:
        duplicate = first_duplicate_id(requests)
    except OSError as exc:
        raise JobError(f"cannot read input file: {exc}") from exc
    if duplicate is None:
        return
    custom_id, first, second = duplicate
    where = (
        f"lines {first.line} and {second.line} of {first.file!r}"
        if first.file == second.file
        else f"line {first.line} of {first.file!r} and line {second.line} of {second.file!r}"
    )
    raise JobError(
        f"custom_id {custom_id!r} is on {where}; each request needs its own custom_id "
        "(results are matched to requests by it)"
    )


def _open_request_file(path: Path, first_row: int) -> InputFile:
    try:
        index = index_request_file(path)
    except OSError as exc:
        raise JobError(f"cannot read input file {str(path)!r}: {exc}") from exc
    return InputFile(path, first_row, index.group_rows, index.sha256, requests=index)


def parquet_footer(path: PurePath, store: Store = LOCAL) -> bytes:
    """The footer bytes of a Parquet file (its metadata), read exactly, without any data."""
    if not store.local:
        return _object_footer(store, path)
    with Path(path).open("rb") as file:
        file.seek(-8, 2)
        tail = file.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != _PARQUET_MAGIC:
            raise OSError(f"{path} is not a Parquet file")
        file.seek(-8 - length, 2)
        return file.read(length)


def _object_footer(store: Store, path: PurePath) -> bytes:
    """parquet_footer of an object: two ranged reads (its tail, then its footer); an OSError of
    one line if the store fails."""
    try:
        file = store.open_input(path)
        size = file.size()
        tail = file.read_at(8, size - 8) if size >= 8 else b""
        if tail[4:] != _PARQUET_MAGIC:
            raise OSError(f"{store.shown(path)} is not a Parquet file")
        length = int.from_bytes(tail[:4], "little")
        return bytes(file.read_at(length, size - 8 - length))
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise OSError(storage_reason(exc, ObjectLocation.parse(store.shown(path)))) from None


def footer_file(footer: bytes) -> bytes:
    """The smallest Parquet file with this footer: what pyarrow needs to parse it (opening the
    file itself would read its last 64 KiB, more than the footer of a small file)."""
    return _PARQUET_MAGIC + footer + len(footer).to_bytes(4, "little") + _PARQUET_MAGIC


def _duplicated_name(schema: pa.Schema) -> str | None:
    seen: set[str] = set()
    for name in schema.names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in schema)


def iter_batches(
    source: InputSource, selection: RowSelection, columns: Sequence[str] | None = None
) -> Iterator[InputBatch]:
    """The selected rows, in row_index order, as record batches of the given columns."""
    for file in source.files:
        try:
            yield from _read_file(file, selection, columns)
        except (OSError, pa.ArrowException) as exc:
            why = exc if file.store.local else storage_reason(exc, ObjectLocation.parse(file.shown))
            raise JobError(f"cannot read input file {file.shown!r}: {why}") from exc


def _read_file(
    file: InputFile, selection: RowSelection, columns: Sequence[str] | None
) -> Iterator[InputBatch]:
    reader: pq.ParquetFile | None = None
    group_start = file.first_row
    for group, num_rows in enumerate(file.row_group_rows):
        start, group_start = group_start, group_start + num_rows
        if not selection.mask(start, group_start).any():
            continue
        if file.requests is not None:
            batches = read_request_rows(
                Path(file.path), file.requests, group, READ_BATCH_ROWS, columns
            )
        else:
            reader = reader or pq.ParquetFile(
                file.store.open_input(file.path), metadata=file.metadata
            )
            batches = reader.iter_batches(
                batch_size=READ_BATCH_ROWS, row_groups=[group], columns=columns
            )
        for batch in batches:
            wanted = selection.mask(start, start + batch.num_rows)
            indices = np.arange(start, start + batch.num_rows, dtype=np.int64)[wanted]
            start += batch.num_rows
            if len(indices):
                yield InputBatch(indices, batch.filter(pa.array(wanted)))
