"""Finished rows to committed parts, written on a background thread: building, writing and
fsyncing a part never stall the engine's steps. Parts are committed one at a time, in order; a
write that fails is raised on the job's thread at its next call, and its rows are simply redone
by the next run (nothing is committed for them). Rows come one at a time (a local run) or as
tables already in the output schema (the output batches of Ray actors)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa

from batchrun.io.output_dir import OutputDir
from batchrun.io.output_schema import OutputRow, build_table, concat_parts, conform_part


class PartWriter:
    def __init__(
        self,
        out: OutputDir,
        schema: pa.Schema,
        rows_per_part: int,
        part_seconds: float,
        committed: Callable[[pa.Table], None],  # called on the writer thread after each part
    ) -> None:
        self.out, self.schema, self.committed = out, schema, committed
        self.rows_per_part, self.part_seconds = rows_per_part, part_seconds
        self.inputs: list[pa.RecordBatch] = []
        self.rows: list[OutputRow] = []
        self.tables: list[pa.Table] = []
        self.table_rows = 0
        self.since = 0.0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchrun-parts")
        self.writes: list[Future[None]] = []

    @property
    def buffered(self) -> int:
        return len(self.rows) + self.table_rows

    def add(self, inputs: pa.RecordBatch, row: OutputRow) -> None:
        if not self.buffered:
            self.since = time.monotonic()
        self.inputs.append(inputs)
        self.rows.append(row)

    def add_table(self, table: pa.Table) -> None:
        """Rows already in the output schema."""
        if not self.buffered:
            self.since = time.monotonic()
        self.tables.append(conform_part(table, self.schema))
        self.table_rows += table.num_rows

    def maybe_commit(self) -> None:
        """Commit the buffer when it holds rows_per_part rows or has waited part_seconds."""
        self._raise_failed()
        full = self.buffered >= self.rows_per_part
        if full or (self.buffered and time.monotonic() - self.since >= self.part_seconds):
            self._submit()

    def flush(self) -> None:
        """Commit what is buffered and wait for every write; raises a write's failure."""
        self._submit()
        for write in self.writes:
            write.result()
        self.writes.clear()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _submit(self) -> None:
        if not self.buffered:
            return
        inputs, rows, tables = self.inputs, self.rows, self.tables
        self.inputs, self.rows, self.tables, self.table_rows = [], [], [], 0
        self.writes.append(self.pool.submit(self._write, inputs, rows, tables))

    def _write(
        self, inputs: list[pa.RecordBatch], rows: list[OutputRow], tables: list[pa.Table]
    ) -> None:
        built = [build_table(self.schema, inputs, rows)] if rows else []
        table = concat_parts(built + tables) if tables else built[0]
        self.out.commit(table)
        self.committed(table)

    def _raise_failed(self) -> None:
        done = [w for w in self.writes if w.done()]
        for write in done:
            write.result()  # raises the failure of a write
        self.writes = [w for w in self.writes if not w.done()]
