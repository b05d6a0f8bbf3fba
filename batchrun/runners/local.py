"""One job from start to end on this process (or, with tp, on each tensor-parallel rank in
lockstep): check everything, then stream rows through the engine into the output sink.

Memory stays bounded: the input is read batch by batch, at most schedule_window rows are read
ahead to be admitted in a better order, at most QUEUE_FACTOR * max_batch_size requests wait in
the engine, and the sink writes finished rows out every rows_per_part rows or part_seconds
seconds. An input row's output rows (its n samples) are written together, into one part:
progress and resume count input rows. SIGTERM and SIGINT stop a run cleanly (StopSignals): what
is finished is committed, and the next run of the same command does the rest.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.errors import JobStopped
from batchrun.io.input.prefetch import prefetch
from batchrun.io.input.prompts import RequestBuilder
from batchrun.io.input.reader import RowSelection
from batchrun.io.output.columns import OutputRow
from batchrun.io.output.sink import OutputSink, RunFacts
from batchrun.io.output.stats import RunClock
from batchrun.runners.engine_feed import EngineLike, build_engine, generate
from batchrun.runners.metrics import (
    JobMetrics,
    MetricsPlan,
    RowShare,
    published,
    read_progress,
)
from batchrun.runners.opened_job import OpenedJob, open_job
from batchrun.runners.row_pipeline import InputRow, Pace, RowPipeline, request_builder
from batchrun.runners.row_sources import FixedRows, RowSource
from batchrun.runners.startup import check_start, start_up_stop
from batchrun.runners.stop_signals import StopSignals, stop_line

if TYPE_CHECKING:
    from batchrun.config.preflight import Preflight
    from batchrun.parallel.group import TensorParallel

TP_STOP_CHECK_STEPS = 8  # tensor-parallel ranks agree on a stop every this many steps


def run_job(
    job: JobSpec, engine: EngineLike | None = None, tp: TensorParallel | None = None
) -> dict[str, Any]:
    """Run the job (or its shard) to the end; returns its stats.json content. Raises JobStopped
    when SIGTERM or SIGINT stopped it first (StopSignals), with what it finished committed.
    It starts with validate's checks (batchrun.runners.startup), without a given engine.

    With tp, every rank of the tensor-parallel group runs this in lockstep on the same input:
    rank 0 alone claims, prepares and writes the output; every rank reads which rows are done
    once rank 0 has prepared, and before it commits anything new."""
    clock = RunClock()
    opened: OpenedJob | None = None
    with StopSignals(lockstep=tp is not None) as stop:
        try:
            found = None
            if tp is None and engine is None:  # validate's checks (the launcher made a rank's)
                checked = check_start(job)
                opened, found = checked.opened, checked.found
            # Rank 0 speaks for its group here too; a busy port stops the job before it starts.
            plan = MetricsPlan.of(job) if tp is None or tp.rank == 0 else None
            with published(plan) as metrics:
                if opened is None:
                    opened = open_job(job)
                return _run_job(job, opened, clock, engine, tp, stop, metrics, found)
        except JobStopped as exc:
            if exc.line is not None or tp is not None:
                raise
            raise start_up_stop(exc, job, opened) from None


def _run_job(
    job: JobSpec,
    opened: OpenedJob,
    clock: RunClock,
    engine: EngineLike | None,
    tp: TensorParallel | None,
    stop: StopSignals,
    metrics: JobMetrics | None = None,
    found: Preflight | None = None,
) -> dict[str, Any]:
    """found: what check_start found (None: a tensor-parallel rank's checks are made here, a
    given engine needs none)."""
    leads = tp is None or tp.rank == 0
    if engine is None and found is None:
        from batchrun.config.preflight import preflight  # needs transformers, as the engine does

        found = preflight(
            job, opened.prompt, opened.row_tokens
        )  # what validate checks, before any weights load
    if leads:
        opened.out.acquire()  # before loading the model: a second run stops at once
    try:
        if engine is None:
            tokenizer, batch = (found.tokenizer, found.batch) if found is not None else (None, None)
            engine = build_engine(job, tokenizer, tp, batch)
        clock.engine_ready()  # tokens/s counts generation only, not start-up and model loading
        builder = request_builder(job, opened.prompt, opened.source.schema, engine, True)
        if leads:
            opened.prepare_output()
        if tp is not None:
            tp.barrier()  # rank 0 has prepared the output: every rank may read it
        run = LocalRun(
            opened, engine, builder, clock, writes=leads, stop=stop, tp=tp, metrics=metrics
        )
        if tp is not None:
            tp.barrier()  # every rank has read the done rows: rank 0 may commit
        stop.defer()
        return run.execute()
    finally:
        opened.out.release()


def summary_line(stats: dict[str, Any], output: str) -> str:
    """What `batchrun run` prints when a job is done."""
    return (
        f"batchrun: {stats['rows']} rows ({stats['ok_rows']} ok, "
        f"{stats['error_rows']} errors), {stats['completion_tokens']} completion tokens "
        f"-> {output}"
    )


class LocalRun:
    """The run loop of one process: rows from its row source through the row pipeline and the
    engine, each row's output rows to the sink."""

    def __init__(
        self,
        opened: OpenedJob,
        engine: EngineLike,
        builder: RequestBuilder,
        clock: RunClock,
        writes: bool = True,
        stop: StopSignals | None = None,
        tp: TensorParallel | None = None,
        metrics: JobMetrics | None = None,
        source: RowSource | None = None,
        pace: Pace | None = None,
        share: RowShare | None = None,
    ) -> None:
        """writes=False: a tensor-parallel rank other than 0, which runs the engine in step
        with rank 0 but writes nothing (the sink's writes). stop: the signals that stop the run
        early (None: none do); tp: the group whose ranks must agree on a stop; metrics: the
        live metrics to feed (None: none asked for). source and pace: where the rows come from
        and how far ahead they are read (None: the job's rows not done, at the job's pace; a
        worker of a multi-worker job reads the chunks it claims, few ahead). share: the input
        rows the metrics report (None: the run's rows)."""
        self.opened, self.job, self.engine, self.builder = opened, opened.job, engine, builder
        self.stop = stop if stop is not None else StopSignals()
        self.tp, self.clock, self.metrics = tp, clock, metrics
        self.steps = 0
        self.stopped = False  # by a signal, with rows left
        self.job_rows = len(opened.rows)
        extra = {"input_rows": self.job_rows, "shard": self.job.run.shard}
        extra["workers"] = self.job.run.workers  # as the --workers parent's stats.json
        self.sink = OutputSink(
            opened.sink_target(),
            clock=clock,
            facts=lambda: RunFacts(engine.info(), engine.block_size, extra),
            writes=writes,
        )
        self.share = share or RowShare(self.job_rows, self.sink.committed_before)
        if source is None:
            source = FixedRows(opened.source, RowSelection(self.sink.done, opened.rows))
        self.source, self.pace = (
            source,
            pace if pace is not None else Pace.of(self.job, engine.max_batch_size),
        )
        self.pipeline = RowPipeline(self.job, engine, self.pace.window)
        # Rows admitted whose samples have not all finished: their input columns.
        self.row_inputs: dict[int, pa.RecordBatch] = {}

    def execute(self) -> dict[str, Any]:
        self.generate_rows()
        return self._finish()

    def generate_rows(self) -> bool:
        """The run without its end (the sink's finish): what a worker of a multi-worker job
        runs, whose parent ends the job. Returns whether a signal stopped it."""
        try:
            with self.sink.writing():
                self._loop()
        finally:
            self.source.release()  # after writing(): its rows are committed (or redone later)
        return self.stopped

    def _loop(self) -> None:
        rows = self._input_rows()
        self._report(force=True)
        try:
            requests = self._requests(rows)
            for finished in generate(self.engine, requests, self.pace.max_queued, self._stopping):
                for request in finished:
                    self._collect(request)
                self.sink.maybe_commit()
                self._report()
        except JobStopped:  # a signal while waiting for input rows
            self.stopped = True
        finally:
            close = getattr(rows, "close", None)
            if close is not None:
                close()  # the prefetch thread stops at its next row (a daemon: never waited for)
        self._report(force=True)  # the figures at the end, for the textfile's last write
        if self.stopped:
            # The requests in flight are dropped, and the rows of which only some samples have
            # finished (never buffered: a part holds all of a row's output rows or none).
            self.engine.abort_all()
            self.row_inputs.clear()
            self.pipeline.clear()

    def _requests(self, rows: Iterator[InputRow]) -> Iterator[Request]:
        """The requests of the input rows, the rows without one buffered as error rows."""
        while True:
            with self.stop.raising():  # waiting for the prefetch thread holds nothing
                row = next(rows, None)
            if row is None:
                return
            request = self._admit(row)
            if request is not None:
                yield request

    def _stopping(self) -> bool:
        """Whether a signal has come (before a step); with tp, whether one came to any rank,
        asked every TP_STOP_CHECK_STEPS steps (a collective), so the ranks stop at one step."""
        if self.tp is None:
            self.stopped = self.stop.signum is not None
        else:
            self.steps += 1
            if self.steps % TP_STOP_CHECK_STEPS == 0:
                signalled = int(self.stop.signum is not None)
                self.stopped = -self.tp.minimum(-signalled) > 0  # the most of the ranks'
        return self.stopped

    def _collect(self, request: Request) -> None:
        """A finished sample; with the row's last one, the row's output rows go to the sink."""
        output, row_index = request.output, request.row_index
        self.sink.count(len(output.token_ids), output.spec_hist, output.spec_rounds)
        if output.error is not None and request.sample_index == 0:  # its grammar's, say
            self.sink.log_error(row_index, self.row_inputs[row_index].to_pylist()[0], output.error)
        done = self.pipeline.finished(row_index, request)
        if done is not None:
            self._add_row(self.row_inputs.pop(row_index), done)

    def _add_row(self, inputs: pa.RecordBatch, rows: list[OutputRow]) -> None:
        """One input row's output rows to the sink, and counted in the live metrics."""
        self.sink.add_row(inputs, rows)
        if self.metrics is not None:
            self.metrics.add_rows(rows, self.share.done(self.sink))

    def _report(self, force: bool = False) -> None:
        """Refresh the live metrics' engine-side figures (at most every REFRESH_SECONDS)."""
        if self.metrics is not None and (force or self.metrics.due()):
            progress = read_progress(self.sink, self.clock, self.engine, self.share)
            self.metrics.refresh(progress)

    def _input_rows(self) -> Iterator[InputRow]:
        """The pipeline's rows of the row source, read and tokenized ahead on a background
        thread (the builder has its own tokenizer)."""
        id_columns = [self.opened.id_column] if self.opened.id_column is not None else []
        rows = self.pipeline.rows(self.source.batches(), self.builder, id_columns)
        return prefetch(rows, depth=self.pace.prefetch_rows)

    def _admit(self, row: InputRow) -> Request | None:
        """The request for the engine, or None: the row's error rows go to the sink."""
        if isinstance(row.request, Request):
            self.row_inputs[row.row_index] = row.inputs
            return row.request
        self.sink.log_error(row.row_index, row.values, row.request)
        self._add_row(row.inputs, self.pipeline.error_rows(row))
        self.sink.maybe_commit()
        return None

    def _finish(self) -> dict[str, Any]:
        # The ranks of a group have buffered the same rows: they agree on whether rows are left.
        stopped = self.stopped and self.sink.done_rows < self.job_rows
        signum = self.stop.signum or signal.SIGTERM  # a rank stopped by another's signal
        if not self.sink.writes:
            if stopped:
                raise JobStopped(signum)  # rank 0 speaks
            return self.sink.current_stats()
        finished = self.sink.finish()
        if stopped:
            left = self.job_rows - finished.committed_rows
            line = stop_line(
                signum,
                finished.committed_rows,
                finished.committed_this_run,
                left,
                self.job.output.overwrite,
            )
            raise JobStopped(signum, line)
        return finished.stats
