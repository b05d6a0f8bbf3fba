"""BatchrunProcessor: the engine as a callable class for Ray Data's map_batches.

    ds.map_batches(
        BatchrunProcessor,
        fn_constructor_kwargs={"target": "models/qwen3-8b", "draft": "models/dflash", ...},
        concurrency=4, num_gpus=1, batch_format="pyarrow",  # or "pandas"
    )

Each actor loads the engine once. A batch holds the input columns of a job (one prompt column,
optional per-row override columns, anything else passes through) and comes back with n output
rows per input row (its samples; one when n = 1), in input order, with the columns of a local
run's part files: the input columns, then row_index, sample_index, completion, ... error. A row
that cannot run is an error row (n of them); a batch whose columns are wrong (no prompt column,
a column named like an output column) raises JobError.

An input column `row_index` (integers, no nulls) names each row: it becomes the output's
row_index and keys the row's default seed, as in a local run (`batchrun run --ray` adds it).
Without one, rows are numbered by their position in the batch, so give rows distinct seeds
with a `seed` column when sampling across batches matters.

This module imports no Ray: the class is plain Python, and also runs on a pyarrow table directly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.errors import JobError
from batchrun.io.input.prompts import RequestBuilder, find_prompt_column
from batchrun.io.input.reader import InputBatch
from batchrun.io.output.columns import OutputRow, build_table
from batchrun.runners.engine_feed import EngineLike, build_engine, generate
from batchrun.runners.row_pipeline import Pace, RowPipeline, request_builder

ROW_INDEX = "row_index"
SAMPLE_INDEX = "sample_index"
# Job keys that concern a job's files and parts, not what a processor computes.
NOT_PROCESSOR_SETTINGS = (
    "input",
    "output",
    "shard",
    "overwrite",
    "quiet",
    "rows_per_part",
    "part_seconds",
    "id_column",
)


def processor_job(settings: Mapping[str, Any]) -> JobSpec:
    """A JobSpec of the processor's settings (job-file keys), checked as a job's are."""
    refused = sorted(key for key in settings if key in NOT_PROCESSOR_SETTINGS)
    if refused:
        raise JobError(f"{refused[0]!r} is not a BatchrunProcessor setting")
    return JobSpec.from_keys({"input": "<ray>", "output": "<ray>", **settings})


def processor_settings(job: JobSpec) -> dict[str, Any]:
    """The job's keys that a BatchrunProcessor takes (its fn_constructor_kwargs)."""
    return {k: v for k, v in job.to_dict().items() if k not in NOT_PROCESSOR_SETTINGS}


class BatchrunProcessor:
    """Runs batches of input rows through one engine; see the module docstring."""

    def __init__(
        self,
        target: str,
        *,
        _engine: EngineLike | None = None,
        _crash_once: str | None = None,
        **settings: Any,
    ) -> None:
        """target and settings: job-file keys (draft, max_tokens, temperature, dtype, ...).
        _engine: an engine already built (tests). _crash_once: a test hook; the first actor
        that creates this file exits mid-batch, as a killed actor would."""
        self.job = processor_job({"target": target, **settings})
        self.engine = _engine if _engine is not None else build_engine(self.job)
        self.pace = Pace.of(self.job, self.engine.max_batch_size)
        self.pipeline = RowPipeline(self.job, self.engine, self.pace.window)
        self.crash_once = _crash_once
        self.builders: dict[pa.Schema, RequestBuilder] = {}

    def __call__(self, batch: Any) -> Any:
        """A batch as pyarrow.Table or RecordBatch, pandas.DataFrame or dict of numpy arrays;
        the output in the same form."""
        if isinstance(batch, pa.Table):
            return self.process(batch)
        if isinstance(batch, pa.RecordBatch):
            return _one_batch(self.process(pa.Table.from_batches([batch])))
        if isinstance(batch, Mapping):
            table = pa.table({name: list(values) for name, values in batch.items()})
            out = self.process(table)
            return {
                name: out.column(name).to_numpy(zero_copy_only=False) for name in out.column_names
            }
        table = pa.Table.from_pandas(batch, preserve_index=False)
        return _to_pandas(self.process(table))

    def process(self, table: pa.Table) -> pa.Table:
        """The output rows of the input rows of `table` (n per row, by sample_index), in the
        same order."""
        row_indices, inputs = _row_indices(table)
        schema = self.job.output_schema(inputs.schema)
        inputs = inputs.replace_schema_metadata(None)
        if inputs.num_rows == 0:
            return build_table(schema, [], [])
        batch = _one_batch(inputs)
        pipeline, builder = self.pipeline, self._builder(inputs.schema)
        pipeline.clear()  # the rows of a batch that failed before
        outputs: list[list[OutputRow]] = [[] for _ in range(batch.num_rows)]
        position: dict[int, int] = {}  # id of a row's request (sample 0) -> its row
        read = InputBatch(np.asarray(row_indices, dtype=np.int64), batch)

        def requests() -> Iterator[Request]:
            for row in pipeline.rows([read], builder):
                if isinstance(row.request, Request):
                    position[id(row.request)] = row.seq
                    yield row.request
                else:
                    outputs[row.seq] = pipeline.error_rows(row)

        for finished in generate(self.engine, requests(), self.pace.max_queued):
            for request in finished:
                first = request.siblings[0] if request.siblings else request
                i = position[id(first)]
                done = pipeline.finished(i, request)
                if done is not None:
                    outputs[i] = done
            if finished:
                self._maybe_crash()
        repeats = [i for i, rows in enumerate(outputs) for _ in rows]
        return build_table(schema, [batch.take(pa.array(repeats))], [r for o in outputs for r in o])

    def _builder(self, schema: pa.Schema) -> RequestBuilder:
        if schema not in self.builders:
            prompt = find_prompt_column(schema, self.job.input)
            self.builders[schema] = request_builder(self.job, prompt, schema, self.engine)
        return self.builders[schema]

    def _maybe_crash(self) -> None:
        if self.crash_once is None:
            return
        try:
            fd = os.open(self.crash_once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            self.crash_once = None  # another actor (or this one before a restart) crashed
            return
        os.close(fd)
        os._exit(1)  # mid-batch: some of its requests are done, none is returned


def _row_indices(table: pa.Table) -> tuple[list[int], pa.Table]:
    """Each row's row_index (from the row_index column, else its position) and the table
    without that column."""
    if ROW_INDEX not in table.column_names:
        return list(range(table.num_rows)), table
    column = table.column(ROW_INDEX)
    if not pa.types.is_integer(column.type) or column.null_count:
        raise JobError(f"input column {ROW_INDEX!r} must hold integers without nulls")
    indices = np.asarray(column.to_numpy(), dtype=np.int64).tolist()
    return indices, table.drop_columns([ROW_INDEX])


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


def _to_pandas(table: pa.Table) -> Any:
    """A DataFrame whose list cells are Python lists (not numpy arrays), as a Parquet reader
    of the parts would give them to pandas users."""
    frame = table.to_pandas()
    for field in table.schema:
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            frame[field.name] = table.column(field.name).to_pylist()
    return frame
