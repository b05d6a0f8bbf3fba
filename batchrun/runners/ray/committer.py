"""The driver's side of `batchrun run --ray`: the actors' output batches into the output sink,
each row_index at most once.

The driver keeps a mask of every row committed or buffered and drops any row it already has (a
batch that Ray ran twice), so none is written twice; a row's n samples go to the sink together
once all have come (Ray may split a batch's output into several blocks), so a part holds all of
a row's output rows or none. The job ends through the sink's finish, complete only when the
committed parts hold every input row; otherwise the run stops with an error, and the next run
does the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from batchrun.errors import JobError
from batchrun.io.input.cells import column_values
from batchrun.io.input.overrides import output_rows
from batchrun.io.output.columns import concat_parts, conform_part
from batchrun.io.output.row_samples import RowSamples
from batchrun.io.output.sink import OutputSink, RunFacts
from batchrun.io.output.stats import RunClock
from batchrun.runners.opened_job import OpenedJob
from batchrun.runners.ray.errors import job_error
from batchrun.runners.ray.processor import ROW_INDEX, SAMPLE_INDEX

# The output columns the driver reads of each output row, besides the id column.
_COUNTED_COLUMNS = [
    ROW_INDEX,
    SAMPLE_INDEX,
    "completion_tokens",
    "spec_rounds",
    "spec_accept_hist",
    "finish_reason",
    "error",
]


def commit_outputs(
    opened: OpenedJob,
    found: dict[str, Any],
    clock: RunClock,
    outputs: Callable[[np.ndarray], Iterable[pa.Table]],
    extra_stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The driver's side of a run: claim the output, then commit the tables that
    outputs(done) yields (output rows, by row_index; done: the committed rows, not called
    when every row is) as parts, then end the job (the sink's finish). found: what preflight
    found (target, draft, device, dtype, attention_backend, kv_cache_dtype, block_size, the
    batch and whether it was chosen)."""
    opened.out.acquire()  # before any actor starts: a second run on this output stops at once
    try:
        opened.prepare_output()
        return RayCommitter(opened, found, clock, extra_stats or {}).execute(outputs)
    finally:
        opened.out.release()


class RayCommitter:
    """Output batches to the sink; each row_index at most once."""

    def __init__(
        self, opened: OpenedJob, found: dict[str, Any], clock: RunClock, extra: dict[str, Any]
    ) -> None:
        self.opened, self.job = opened, opened.job
        self.total = opened.source.total_rows
        self.duplicates = 0  # output rows of a batch that Ray ran twice, returned again: dropped
        self.sink = OutputSink(
            opened.sink_target(),
            clock=clock,
            facts=lambda: RunFacts(
                found,
                found["block_size"],
                {
                    "input_rows": self.total,
                    "shard": None,
                    "ray": {**extra, "duplicate_rows_dropped": self.duplicates},
                },
            ),
        )
        self.seen = self.sink.done.copy()  # committed, then also buffered by this run
        self.samples: RowSamples[pa.Table] = RowSamples()  # by row_index, one output row each
        # Each row's n: its `n` cell, if the input has the column, else the job's.
        self.n_column = "n" if "n" in opened.source.schema.names else None

    def execute(self, outputs: Callable[[np.ndarray], Iterable[pa.Table]]) -> dict[str, Any]:
        try:
            with self.sink.writing():
                if self.sink.done_rows < self.total:
                    for table in outputs(self.seen.copy()):
                        self._take(table)
        except Exception as exc:
            error = job_error(exc)
            if error is None:
                raise
            raise error from None
        finished = self.sink.finish()
        if finished.missing_rows:
            raise JobError(
                f"{finished.missing_rows} input rows got no output row from the Ray cluster; "
                "run the job again to do them"
            )
        return finished.stats

    def _take(self, table: pa.Table) -> None:
        """Pass on the rows of an output batch whose samples have all come, unless this run has
        them already."""
        table = conform_part(table, self.opened.schema)
        indices = table.column(ROW_INDEX).to_numpy()
        if len(indices) and (indices.min() < 0 or indices.max() >= self.total):
            raise JobError(f"Ray returned a row_index outside the input's {self.total} rows")
        samples = table.column(SAMPLE_INDEX).to_pylist()
        n_cells = column_values(table.column(self.n_column)) if self.n_column else None
        complete: list[pa.Table] = []
        rows_complete = 0
        for i, (row, sample) in enumerate(zip(indices.tolist(), samples, strict=True)):
            if self.seen[row] or self.samples.holds(row, sample):
                self.duplicates += 1
                continue
            n = output_rows(n_cells[i] if n_cells else None, self.job.sampling.n)
            done = self.samples.add(row, sample, n, table.slice(i, 1))
            if done is not None:
                self.seen[row] = True
                rows_complete += 1
                complete += done
        if not complete:
            return
        rows = concat_parts(complete)
        self._count(rows)
        self.sink.add_table(rows, input_rows=rows_complete)
        self.sink.maybe_commit()

    def _count(self, table: pa.Table) -> None:
        id_column = self.opened.id_column
        columns = [*_COUNTED_COLUMNS, *([id_column] if id_column else [])]
        for row in table.select(columns).to_pylist():
            if row["finish_reason"] == "error":  # (a generated row's error is only a note)
                if row[SAMPLE_INDEX] == 0:  # once per input row, as a local run logs
                    self.sink.log_error(row[ROW_INDEX], row, row["error"])
                self.sink.count(row["completion_tokens"], None, 0)  # 0 in error rows
            else:
                self.sink.count(
                    row["completion_tokens"], row["spec_accept_hist"], row["spec_rounds"]
                )
