"""The one writer of a job's output, for every runner (the local run, each torchrun rank, each
--workers worker, the Ray driver), and the one end of every job: it seeds the statistics from
the parts committed before, buffers finished rows and commits them as parts on a background
thread, counts this run's tokens and speculation, drives the progress bar and the error log,
flushes what is finished whatever stops the run, and at the end (finish) writes stats.json and,
once every input row has its output rows, _SUCCESS. The parent of --workers, which writes no
rows, ends its job here too once its workers are done (its workers' tokens and timing given).

Parts are committed one at a time, in order, on the writer thread: building, writing and fsyncing
a part never stall the engine's steps. A write that fails is raised on the job's thread at its
next call, and its rows are simply redone by the next run (nothing is committed for them). An
input row's output rows (its n samples) are buffered together, so a part never splits them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchrun.engine.core.requests import round_tokens
from batchrun.io.output.columns import OutputRow, build_table, concat_parts, conform_part
from batchrun.io.output.directory import STATS_FILE, OutputDir
from batchrun.io.output.progress_bar import ErrorLog, ProgressBar
from batchrun.io.output.stats import STATS_COLUMNS, RunClock, StatsAccumulator, Timing


@dataclass(frozen=True)
class SinkTarget:
    """Where and how a run writes: `out` (claimed and prepared by the runner), the schema of every
    part, the job's input rows (every row_index is below total_rows) and this run's range of
    them (its shard's, or every row), rows_per_part and part_seconds bound a part's rows and
    age, and the progress bar and error log stay silent when quiet."""

    out: OutputDir
    schema: pa.Schema
    total_rows: int
    rows: range
    rows_per_part: int
    part_seconds: float
    quiet: bool
    id_column: str | None


@dataclass(frozen=True)
class RunFacts:
    """What stats.json says besides the rows' statistics: the engine's info (target, draft,
    dtype, ...), the DFlash block size (None without a draft) and keys of the runner's own;
    timing: the run's, when its engines ran elsewhere (None: the sink's clock's)."""

    info: dict[str, Any]
    block_size: int | None
    extra: dict[str, Any]
    timing: Timing | None = None


@dataclass(frozen=True)
class Finished:
    """The end of a run: its stats.json content, the input rows of the whole job still without
    output rows (0: _SUCCESS was written), and the rows of this run's range committed, in all
    and by this run."""

    stats: dict[str, Any]
    missing_rows: int
    committed_rows: int
    committed_this_run: int


class OutputSink:
    """See the module docstring. writes=False: a tensor-parallel rank other than 0, which counts
    as rank 0 does but writes nothing (no parts, stats, progress bar or error log)."""

    def __init__(
        self,
        target: SinkTarget,
        *,
        clock: RunClock,
        facts: Callable[[], RunFacts],
        writes: bool = True,
    ) -> None:
        self.target, self.out, self.clock, self.facts = target, target.out, clock, facts
        self.writes = writes
        rows = target.rows
        self.done = self.out.done_mask(target.total_rows)  # committed by earlier runs
        self.done_rows = int(self.done[rows.start : rows.stop].sum())  # then buffered too
        self.committed_before = self.done_rows
        self.stats = StatsAccumulator()  # unsharded: every committed row, other shards' too
        for part in self.out.stats_parts():
            self.stats.add(self.out.read_table(part, STATS_COLUMNS))
        self.run_tokens = 0  # generated in this run, for tokens/s
        self.run_spec_tokens = 0
        self.run_spec_rounds = 0
        quiet = target.quiet or not writes
        self.bar = ProgressBar(len(rows), enabled=not quiet)
        self.error_log = ErrorLog(self.bar, quiet, target.id_column)
        self.writer = _PartWriter(target, self._committed)

    # -- while the run runs -------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self) -> Iterator[OutputSink]:
        """Within: the run. On the way out, what is buffered is committed, also when the run
        failed or stopped (finished rows are good output whatever stopped the job)."""
        try:
            yield self
            self.writer.flush()
        except BaseException:
            with contextlib.suppress(Exception):
                self.writer.flush()
            raise
        finally:
            self.writer.close()
            self.bar.close()

    def count(self, completion_tokens: int, spec_hist: Any, spec_rounds: int) -> None:
        """Tokens this run generated (a finished sample's, or a --workers worker's, counted by
        its parent), and their speculation rounds (spec_hist None without a draft or not
        known)."""
        self.run_tokens += completion_tokens
        if spec_hist is not None:  # the tokens of its speculation rounds
            self.run_spec_tokens += round_tokens(spec_hist)
            self.run_spec_rounds += spec_rounds

    def log_error(self, row_index: int, values: dict[str, Any], message: str) -> None:
        self.error_log.log(row_index, values, message)

    def add_row(self, inputs: pa.RecordBatch, rows: list[OutputRow]) -> None:
        """One input row's output rows (all its samples), from its input columns."""
        for row in rows if self.writes else ():
            self.writer.add(inputs, row)
        self._rows_done(1)

    def add_table(self, table: pa.Table, input_rows: int) -> None:
        """Whole input rows' output rows already in the output schema (`input_rows` of them)."""
        if self.writes:
            self.writer.add_table(table)
        self._rows_done(input_rows)

    def maybe_commit(self) -> None:
        """Commit the buffer when it holds rows_per_part rows or has waited part_seconds."""
        self.writer.maybe_commit()

    def _rows_done(self, count: int) -> None:
        self.done_rows += count
        tau = self.run_spec_tokens / self.run_spec_rounds if self.run_spec_rounds else None
        self.bar.update(self.done_rows, self.run_tokens, tau)

    def _committed(self, table: pa.Table) -> None:
        """After each part (on the writer thread): its rows count, stats.json is rewritten."""
        self.stats.add(table)
        self.out.write_json(self.out.stats_path, self.current_stats())

    # -- the end ------------------------------------------------------------------------------

    def current_stats(self) -> dict[str, Any]:
        """stats.json's content now (this run's tokens over its generation time)."""
        facts = self.facts()
        return self.stats.to_dict(
            info=facts.info,
            block_size=facts.block_size,
            timing=facts.timing if facts.timing is not None else self.clock.timing(),
            run_completion_tokens=self.run_tokens,
            extra=facts.extra,
        )

    def finish(self) -> Finished:
        """After writing(): stats.json, and _SUCCESS last once every input row has its output
        rows (with shards, the last shard to finish also writes the job-wide stats.json)."""
        target = self.target
        if len(target.rows) == 0 and not self.out.own_parts():
            # A zero-row job (or shard) still leaves a part: readers find the output schema.
            self.out.commit(build_table(target.schema, [], []))
        stats = self.current_stats()
        self.out.write_json(self.out.stats_path, stats)
        done = self.out.done_mask(target.total_rows)
        missing = int((~done).sum())
        if not missing:
            if self.out.names.shard is not None:
                self._write_job_wide_stats()
            self.out.mark_success()  # last: every input row has its output row
        committed = int(done[target.rows.start : target.rows.stop].sum())
        return Finished(stats, missing, committed, committed - self.committed_before)

    def _write_job_wide_stats(self) -> None:
        """The last shard to finish writes stats.json over every shard's parts."""
        totals = StatsAccumulator()
        for part in self.out.committed_parts():
            totals.add(self.out.read_table(part, STATS_COLUMNS))
        facts = self.facts()
        stats = totals.to_dict(
            info=facts.info,
            block_size=facts.block_size,
            timing=Timing.longest(self.out.shard_timings()),  # shards run side by side
            run_completion_tokens=totals.completion_tokens,
            extra={**facts.extra, "input_rows": self.target.total_rows, "shard": None},
        )
        self.out.write_json(self.out.path / STATS_FILE, stats)


class _PartWriter:
    """The sink's buffer of finished rows and the background thread that commits them. Rows come
    one at a time with their input columns (a local run) or as tables already in the output
    schema (the output batches of Ray actors)."""

    def __init__(self, target: SinkTarget, committed: Callable[[pa.Table], None]) -> None:
        self.out, self.schema, self.committed = target.out, target.schema, committed
        self.rows_per_part, self.part_seconds = target.rows_per_part, target.part_seconds
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
        if not self.buffered:
            self.since = time.monotonic()
        self.tables.append(conform_part(table, self.schema))
        self.table_rows += table.num_rows

    def maybe_commit(self) -> None:
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
