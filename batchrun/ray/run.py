"""`batchrun run JOB --ray [ADDRESS]`: one job over a Ray cluster, with Ray Data as the engine.

    read      ray.data.from_items(row groups with rows to do) -> map_batches(read_row_groups)
    generate  map_batches(BatchrunProcessor): an actor pool, one actor per GPU (--replicas)
    commit    this process (the driver): parts, _progress, stats.json, _SUCCESS

Exactly once per input row, as in a local run, because only the driver writes the output, under
its claim, with the local run's atomic part commits (batchrun.io.output_dir):
- each row carries its row_index from the read stage, numbered as a local run numbers it (files
  sorted by path, rows in file order); row groups whose rows are all committed are not read, and
  committed rows of the others are dropped as they are read;
- a row is done when a committed part holds it. An actor that dies mid-batch returns nothing for
  that batch; Ray restarts the actor and runs the batch again, so its rows come once more;
- the driver keeps a mask of every row committed or buffered and drops any row it already has
  (a batch that Ray ran twice), so none is written twice; a row's n samples are buffered
  together once all have come (Ray may split a batch's output into several blocks), so a part
  holds all of a row's output rows or none;
- _SUCCESS is written only when the committed parts hold every input row; otherwise the run
  stops with an error, and the next run does the rest.
The driver reads the input's footers and the models' config files, and the actors read the input
and the models: their paths must be the same on every node (a shared filesystem). The output
directory is written by the driver alone.

Why not ray.data.read_parquet: its blocks do not say where in a file their rows are, and the row
index (resume, seeds, the output's row_index) must be the local run's. The read stage reads the
same Parquet row groups with pyarrow inside Ray tasks instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.engine.request import round_tokens
from batchrun.errors import JobError
from batchrun.io.cells import column_values
from batchrun.io.output_dir import DAMAGED_DIR, PROGRESS_DIR, row_ranges
from batchrun.io.output_schema import build_table, concat_parts, conform_part
from batchrun.io.overrides import output_rows
from batchrun.io.part_writer import PartWriter
from batchrun.io.progress_bar import ProgressBar
from batchrun.io.prompts import PromptColumn, find_prompt_column
from batchrun.io.reader import open_input
from batchrun.job import JobSpec
from batchrun.pipeline import QUEUE_FACTOR, ErrorLog, OpenedJob, open_job
from batchrun.ray.processor import ROW_INDEX, SAMPLE_INDEX, BatchrunProcessor, processor_settings
from batchrun.stats import STATS_COLUMNS, RunClock, StatsAccumulator

CRASH_ONCE_ENV = "BATCHRUN_TEST_RAY_CRASH_ONCE"  # test hook: see BatchrunProcessor._crash_once
READ_BATCH_ROWS = 1024  # rows per block of the read stage


def import_ray() -> Any:
    try:
        import ray
        import ray.data
    except ImportError:
        raise JobError("--ray needs Ray: pip install 'batchrun[ray]'") from None
    return ray


def run_job_ray(
    job: JobSpec, address: str | None = None, replicas: int | None = None
) -> dict[str, Any]:
    """Run the job on the Ray cluster at `address` (None: the one this machine or RAY_ADDRESS
    names, else a new local one) with `replicas` engine actors (None: one per GPU, or 1 without
    GPUs); returns its stats.json content. Raises JobError."""
    ray = import_ray()
    if job.shard is not None:
        raise JobError("--ray runs every row of the job; leave out shard")
    if replicas is not None and replicas < 1:
        raise JobError(f"--replicas must be at least 1, got {replicas}")
    clock = RunClock()
    source = open_input(job.input, exclude=Path(job.output))  # these checks need no cluster
    prompt = find_prompt_column(source.schema, job)
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING)
    gpus = int(ray.cluster_resources().get("GPU", 0)) if job.device != "cpu" else 0
    resources: dict[str, Any] = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    found = _probe(ray, job, prompt, resources)
    if job.dtype == "auto":  # the fingerprint holds the dtype the actors resolve, not ours
        job = dataclasses.replace(job, dtype=found["dtype"])
    opened = open_job(job)
    count = replicas or max(gpus, 1)

    def outputs(done: np.ndarray) -> Iterable[pa.Table]:
        dataset = _dataset(ray, opened, done, count, resources)
        batches: Iterable[pa.Table] = dataset.iter_batches(batch_format="pyarrow", batch_size=None)
        return batches

    clock.engine_ready()  # the actors load their models within generation_seconds
    return commit_outputs(opened, found, clock, outputs, {"replicas": count})


def commit_outputs(
    opened: OpenedJob,
    found: dict[str, Any],
    clock: RunClock,
    outputs: Callable[[np.ndarray], Iterable[pa.Table]],
    extra_stats: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The driver's side of a run: claim the output, then commit the tables that
    outputs(done) yields (output rows, by row_index; done: the committed rows, not called
    when every row is) as parts, with stats.json and at last _SUCCESS. found: what preflight
    found (target, draft, device, dtype, attention_backend, kv_cache_dtype, block_size)."""
    opened.out.acquire()  # before any actor starts: a second run on this output stops at once
    try:
        damaged = opened.out.prepare(opened.fingerprint, opened.job.overwrite)
        if damaged:
            print(
                f"batchrun: warning: {len(damaged)} damaged part(s) moved to "
                f"{PROGRESS_DIR}/{DAMAGED_DIR}/ ({', '.join(damaged)}); their rows are redone",
                file=sys.stderr,
            )
        return _Committer(opened, found, clock, extra_stats or {}).execute(outputs)
    finally:
        opened.out.release()


def _probe(
    ray: Any, job: JobSpec, prompt: PromptColumn, resources: dict[str, Any]
) -> dict[str, Any]:
    """The start-up checks of preflight, run where an actor runs (a GPU node if actors get
    GPUs): what device, dtype and backend the actors will resolve."""
    task = ray.remote(max_retries=0, **resources)(preflight_info)
    try:
        found: dict[str, Any] = ray.get(task.remote(job, prompt))
    except Exception as exc:
        error = _job_error(exc)
        if error is None:
            raise
        raise error from None
    return found


def preflight_info(job: JobSpec, prompt: PromptColumn) -> dict[str, Any]:
    """What commit_outputs needs to know of the engine, found by preflight (no weights)."""
    from batchrun.attention.kv_dtype import kv_dtype
    from batchrun.preflight import preflight

    found = preflight(job, prompt)
    return {
        "target": job.target,
        "draft": job.draft,
        "device": str(found.device),
        "dtype": str(found.dtype).removeprefix("torch."),
        "attention_backend": found.attention_backend,
        "kv_cache_dtype": str(kv_dtype(job.kv_cache_dtype, found.dtype)).removeprefix("torch."),
        "block_size": found.block_size,
    }


def _job_error(exc: BaseException) -> JobError | None:
    """The JobError a Ray error wraps (a remote task's or actor's), if any."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, JobError):
            return JobError(str(current))
        todo += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return None


def read_row_groups(units: pa.Table) -> Iterator[pa.Table]:
    """The read stage: the rows of each unit (one row group) that are not done, with their
    row_index column; one table per READ_BATCH_ROWS rows read."""
    for unit in units.to_pylist():
        done = np.zeros(unit["rows"], dtype=bool)
        for start, stop in json.loads(unit["done"]):
            done[start:stop] = True
        reader = pq.ParquetFile(unit["path"])
        offset = 0
        for batch in reader.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=[unit["group"]]):
            wanted = ~done[offset : offset + batch.num_rows]
            indices = np.arange(offset, offset + batch.num_rows, dtype=np.int64) + unit["first"]
            offset += batch.num_rows
            if wanted.any():
                table = pa.Table.from_batches([batch.filter(pa.array(wanted))])
                yield table.append_column(ROW_INDEX, pa.array(indices[wanted]))


def row_group_units(opened: OpenedJob, done: np.ndarray) -> list[dict[str, Any]]:
    """One unit per row group that holds rows not done; `done` ranges relative to the group."""
    units = []
    for file in opened.source.files:
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


def _dataset(
    ray: Any, opened: OpenedJob, done: np.ndarray, replicas: int, resources: dict[str, Any]
) -> Any:
    """The read and generate stages over the rows not done."""
    ray.data.DataContext.get_current().enable_progress_bars = False  # batchrun draws its own
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # not each dataset's plan
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    settings = processor_settings(opened.job)
    crash = os.environ.get(CRASH_ONCE_ENV)
    if crash:
        settings["_crash_once"] = crash
    reads = ray.data.from_items(row_group_units(opened, done)).map_batches(
        read_row_groups, batch_size=1, batch_format="pyarrow", num_cpus=0
    )
    # Ray Data restarts an actor that dies (max_restarts=-1) and runs its batch again
    # (max_task_retries=-1): its defaults for actor pools.
    return reads.map_batches(
        BatchrunProcessor,
        fn_constructor_kwargs=settings,
        batch_size=QUEUE_FACTOR * opened.job.max_batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=replicas),
        **resources,
    )


class _Committer:
    """Output batches to committed parts; each row_index at most once."""

    def __init__(
        self, opened: OpenedJob, found: dict[str, Any], clock: RunClock, extra: dict[str, Any]
    ) -> None:
        self.opened, self.job, self.out = opened, opened.job, opened.out
        self.found, self.clock, self.extra = found, clock, extra
        self.total = opened.source.total_rows
        self.seen = self.out.done_mask(self.total)  # committed, then also buffered by this run
        self.done_rows = int(self.seen.sum())
        self.partial: dict[int, dict[int, pa.Table]] = {}  # row -> sample_index -> output row
        # Each row's n: its `n` cell, if the input has the column, else the job's.
        self.n_column = "n" if "n" in opened.source.schema.names else None
        self.stats = StatsAccumulator()
        for part in self.out.committed_parts():
            self.stats.add(pq.read_table(part, columns=STATS_COLUMNS))
        self.writer = PartWriter(
            self.out, opened.schema, self.job.rows_per_part, self.job.part_seconds, self._committed
        )
        self.run_tokens = 0
        self.run_spec_tokens = 0
        self.run_spec_rounds = 0
        self.duplicates = 0  # output rows of a batch that Ray ran twice, returned again: dropped
        self.bar = ProgressBar(self.total, enabled=not self.job.quiet)
        self.error_log = ErrorLog(self.bar, self.job.quiet, opened.id_column)

    def execute(self, outputs: Callable[[np.ndarray], Iterable[pa.Table]]) -> dict[str, Any]:
        try:
            if self.done_rows < self.total:
                for table in outputs(self.seen.copy()):
                    self._take(table)
            self.writer.flush()
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self.writer.flush()  # finished rows are good output whatever stopped the job
            error = _job_error(exc) if isinstance(exc, Exception) else None
            if error is None:
                raise
            raise error from None
        finally:
            self.writer.close()
            self.bar.close()
        return self._finish()

    def _take(self, table: pa.Table) -> None:
        """Buffer the rows of an output batch whose samples have all come, unless this run has
        them already."""
        table = conform_part(table, self.opened.schema)
        indices = table.column(ROW_INDEX).to_numpy()
        if len(indices) and (indices.min() < 0 or indices.max() >= self.total):
            raise JobError(f"Ray returned a row_index outside the input's {self.total} rows")
        samples = table.column(SAMPLE_INDEX).to_pylist()
        n_cells = column_values(table.column(self.n_column)) if self.n_column else None
        complete: list[pa.Table] = []
        for i, (row, sample) in enumerate(zip(indices.tolist(), samples, strict=True)):
            held = None if self.seen[row] else self.partial.setdefault(row, {})
            if held is None or sample in held:
                self.duplicates += 1
                continue
            held[sample] = table.slice(i, 1)
            if len(held) == output_rows(n_cells[i] if n_cells else None, self.job.n):
                del self.partial[row]
                self.seen[row] = True
                self.done_rows += 1
                complete += [held[s] for s in sorted(held)]
        if not complete:
            return
        rows = concat_parts(complete)
        self._count(rows)
        self.writer.add_table(rows)
        self.writer.maybe_commit()
        tau = self.run_spec_tokens / self.run_spec_rounds if self.run_spec_rounds else None
        self.bar.update(self.done_rows, self.run_tokens, tau)

    def _count(self, table: pa.Table) -> None:
        id_column = self.opened.id_column
        columns = [ROW_INDEX, SAMPLE_INDEX, "completion_tokens", "spec_rounds", "spec_accept_hist"]
        columns += ["finish_reason", "error", *([id_column] if id_column else [])]
        for row in table.select(columns).to_pylist():
            if row["finish_reason"] == "error":  # (a generated row's error is only a note)
                if row[SAMPLE_INDEX] == 0:  # once per input row, as a local run logs
                    self.error_log.log(row[ROW_INDEX], row, row["error"])
            elif row["spec_accept_hist"] is not None:
                hist = row["spec_accept_hist"]
                self.run_spec_tokens += round_tokens(hist)
                self.run_spec_rounds += row["spec_rounds"]
            self.run_tokens += row["completion_tokens"]  # 0 in error rows

    def _committed(self, table: pa.Table) -> None:
        """After each part (on the writer thread): its rows count, stats.json is rewritten."""
        self.stats.add(table)
        self.out.write_json(self.out.stats_path, self._stats())

    def _stats(self) -> dict[str, Any]:
        return self.stats.to_dict(
            info=self.found,
            block_size=self.found["block_size"],
            timing=self.clock.timing(),
            run_completion_tokens=self.run_tokens,
            extra={
                "input_rows": self.total,
                "shard": None,
                "ray": {**self.extra, "duplicate_rows_dropped": self.duplicates},
            },
        )

    def _finish(self) -> dict[str, Any]:
        if self.total == 0 and not self.out.committed_parts():
            # A zero-row job still leaves a part: readers find the output schema.
            self.out.commit(build_table(self.opened.schema, [], []))
        stats = self._stats()
        self.out.write_json(self.out.stats_path, stats)
        missing = int((~self.out.done_mask(self.total)).sum())
        if missing:
            raise JobError(
                f"{missing} input rows got no output row from the Ray cluster; "
                "run the job again to do them"
            )
        self.out.mark_success()  # last: every input row has its output row
        return stats
