"""Where a runner's input rows come from: one interface, RowSource, for every way a job's rows are
shared out. A fixed range (a local run, a shard, a torchrun group: FixedRows), chunks claimed as
a worker needs rows (--workers: batchrun.runners.workers.chunks.ChunkPuller) and Parquet row
groups read inside Ray tasks (--ray: RowGroups). Each gives its rows not done yet, as batches
that carry their row_index, and lets go of what it holds once the run's rows are committed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.input.reader import InputBatch, InputSource, RowSelection, iter_batches
from batchrun.io.output.directory import row_ranges


class RowSource(Protocol):
    def batches(self) -> Iterator[InputBatch]:
        """The rows to run, with their row_index, those done already left out."""
        ...

    def release(self) -> None:
        """Let go of what the source holds (claims); called once the run's rows are committed."""
        ...


class FixedRows:
    """The rows of a fixed range (a shard's, or every row) that the selection has not done."""

    def __init__(self, source: InputSource, selection: RowSelection) -> None:
        self.source, self.selection = source, selection

    def batches(self) -> Iterator[InputBatch]:
        return iter_batches(self.source, self.selection)

    def release(self) -> None:
        pass  # a fixed range holds nothing


class RowGroups:
    """Whole Parquet row groups, each a unit (a dict: path, group, its first row_index, rows,
    and the ranges of its rows done as JSON), as Ray's read stage passes them to its tasks;
    read batch_rows rows at a time."""

    def __init__(self, units: list[dict[str, Any]], batch_rows: int) -> None:
        self.units, self.batch_rows = units, batch_rows

    @staticmethod
    def plan(source: InputSource, done: np.ndarray) -> list[dict[str, Any]]:
        """One unit per row group that holds rows not done; `done` ranges relative to the
        group."""
        units = []
        for file in source.files:
            first = file.first_row
            for group, rows in enumerate(file.row_group_rows):
                group_done = done[first : first + rows]
                if not group_done.all():
                    units.append(
                        {
                            "path": str(file.path),
                            "group": group,
                            "first": first,
                            "rows": rows,
                            "done": json.dumps(row_ranges(np.flatnonzero(group_done))),
                        }
                    )
                first += rows
        return units

    def batches(self) -> Iterator[InputBatch]:
        """The rows of each unit not done."""
        for unit in self.units:
            done = np.zeros(unit["rows"], dtype=bool)
            for start, stop in json.loads(unit["done"]):
                done[start:stop] = True
            reader = pq.ParquetFile(unit["path"])
            offset = 0
            for batch in reader.iter_batches(self.batch_rows, row_groups=[unit["group"]]):
                wanted = ~done[offset : offset + batch.num_rows]
                indices = np.arange(offset, offset + batch.num_rows, dtype=np.int64) + unit["first"]
                offset += batch.num_rows
                if wanted.any():
                    yield InputBatch(indices[wanted], batch.filter(pa.array(wanted)))

    def release(self) -> None:
        pass  # Ray's driver holds the output's claim
