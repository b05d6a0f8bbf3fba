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

import contextlib
import copy
import signal
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.errors import JobStopped, signal_name
from batchrun.io.input.prefetch import prefetch
from batchrun.io.input.prompts import RequestBuilder
from batchrun.io.input.reader import InputBatch, RowSelection, iter_batches
from batchrun.io.output.columns import OutputRow, error_rows, finished_row
from batchrun.io.output.directory import DAMAGED_DIR, PROGRESS_DIR
from batchrun.io.output.reasoning import reasoning_split
from batchrun.io.output.row_samples import RowSamples
from batchrun.io.output.sink import OutputSink, RunFacts
from batchrun.io.output.stats import RunClock
from batchrun.runners.admission_order import windowed
from batchrun.runners.engine_feed import QUEUE_FACTOR, EngineLike, build_engine, generate
from batchrun.runners.metrics import JobMetrics, MetricsPlan, published, read_progress
from batchrun.runners.opened_job import OpenedJob, open_job
from batchrun.runners.stop_signals import StopSignals, stop_line

if TYPE_CHECKING:
    from batchrun.parallel.group import TensorParallel

# An input row: its row_index, input columns, values of the columns read, request (or why not).
InputRow = tuple[int, pa.RecordBatch, dict[str, Any], Request | str]
PREFETCH_ROWS = 512  # input rows read and tokenized ahead of the engine
TP_STOP_CHECK_STEPS = 8  # tensor-parallel ranks agree on a stop every this many steps


def run_job(
    job: JobSpec, engine: EngineLike | None = None, tp: TensorParallel | None = None
) -> dict[str, Any]:
    """Run the job (or its shard) to the end; returns its stats.json content. Raises JobStopped
    when SIGTERM or SIGINT stopped it first (StopSignals), with what it finished committed.

    With tp, every rank of the tensor-parallel group runs this in lockstep on the same input:
    rank 0 alone claims, prepares and writes the output; every rank reads which rows are done
    once rank 0 has prepared, and before it commits anything new."""
    clock = RunClock()
    opened: OpenedJob | None = None
    with StopSignals(lockstep=tp is not None) as stop:
        try:
            # Rank 0 speaks for its group here too; a busy port stops the job before it starts.
            plan = MetricsPlan.of(job) if tp is None or tp.rank == 0 else None
            with published(plan) as metrics:
                opened = open_job(job)
                return _run_job(job, opened, clock, engine, tp, stop, metrics)
        except JobStopped as exc:
            if exc.line is not None or tp is not None:
                raise
            # Stopped in start-up: nothing was generated; say what earlier runs committed.
            line = f"batchrun: stopped by {signal_name(exc.signum)} before the job started; "
            line += "run the same command again to start it"
            if opened is not None:
                with contextlib.suppress(Exception):
                    committed = opened.committed_rows()
                    left = len(opened.rows) - committed
                    line = stop_line(exc.signum, committed, 0, left, job.output.overwrite)
            raise JobStopped(exc.signum, line) from None


def _run_job(
    job: JobSpec,
    opened: OpenedJob,
    clock: RunClock,
    engine: EngineLike | None,
    tp: TensorParallel | None,
    stop: StopSignals,
    metrics: JobMetrics | None = None,
) -> dict[str, Any]:
    leads = tp is None or tp.rank == 0
    found = None
    if engine is None:
        from batchrun.config.preflight import preflight  # needs transformers, as the engine does

        found = preflight(job, opened.prompt)  # what validate checks, before any weights load
    if leads:
        opened.out.acquire()  # before loading the model: a second run stops at once
    try:
        if engine is None:
            engine = build_engine(job, found.tokenizer if found is not None else None, tp)
        clock.engine_ready()  # tokens/s counts generation only, not start-up and model loading
        builder = request_builder(job, opened, engine)
        damaged = opened.out.prepare(opened.fingerprint, job.output.overwrite) if leads else []
        if damaged:
            print(
                f"batchrun: warning: {len(damaged)} damaged part(s) moved to "
                f"{PROGRESS_DIR}/{DAMAGED_DIR}/ ({', '.join(damaged)}); their rows are redone",
                file=sys.stderr,
            )
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


def request_builder(job: JobSpec, opened: OpenedJob, engine: EngineLike) -> RequestBuilder:
    """What turns the job's input rows into the engine's requests."""
    return RequestBuilder(
        job.row_defaults(),
        opened.prompt,
        opened.source.schema,
        copy.deepcopy(engine.tokenizer),  # used on the prefetch thread only
        engine.max_model_len,
        engine.vocab_size,
        lambda: engine.grammars,
    )


def summary_line(stats: dict[str, Any], output: str) -> str:
    """What `batchrun run` prints when a job is done."""
    return (
        f"batchrun: {stats['rows']} rows ({stats['ok_rows']} ok, "
        f"{stats['error_rows']} errors), {stats['completion_tokens']} completion tokens "
        f"-> {output}"
    )


class LocalRun:
    """The run loop of one process: input rows to requests, requests through the engine, each
    row's finished samples to the sink."""

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
    ) -> None:
        """writes=False: a tensor-parallel rank other than 0, which runs the engine in step
        with rank 0 but writes nothing (the sink's writes). stop: the signals that stop the run
        early (None: none do); tp: the group whose ranks must agree on a stop; metrics: the
        live metrics to feed (None: none asked for)."""
        self.opened, self.job, self.engine, self.builder = opened, opened.job, engine, builder
        self.reasoning = reasoning_split(self.job.output.reasoning_parser, engine.tokenizer)
        self.stop = stop if stop is not None else StopSignals()
        self.tp, self.clock, self.metrics = tp, clock, metrics
        self.steps = 0
        self.stopped = False  # by a signal, with rows left
        self.job_rows = len(opened.rows)
        extra = {"input_rows": self.job_rows, "shard": self.job.run.shard}
        self.sink = OutputSink(
            opened.sink_target(),
            clock=clock,
            facts=lambda: RunFacts(engine.info(), engine.block_size, extra),
            writes=writes,
        )
        self.selection = RowSelection(self.sink.done, opened.rows)
        # Where the input rows come from, and how many are read and queued ahead: a worker of
        # a multi-worker job (batchrun.runners.workers) reads the chunks it claims, few ahead.
        self.batches: Callable[[], Iterator[InputBatch]] = lambda: iter_batches(
            opened.source, self.selection
        )
        self.prefetch_rows = PREFETCH_ROWS
        self.max_queued = QUEUE_FACTOR * self.job.engine.max_batch_size  # requests in the engine
        self.window = self.job.run.schedule_window
        # Rows admitted whose samples have not all finished: their input columns, and samples.
        self.row_inputs: dict[int, pa.RecordBatch] = {}
        self.samples: RowSamples[Request] = RowSamples()

    def execute(self) -> dict[str, Any]:
        with self.sink.writing():
            self._loop()
        return self._finish()

    def generate_rows(self) -> bool:
        """The run without its end (stats.json, _SUCCESS): what a worker of a multi-worker job
        runs, whose parent ends the job. Returns whether a signal stopped it."""
        with self.sink.writing():
            self._loop()
        return self.stopped

    def _loop(self) -> None:
        rows = self._input_rows()
        self._report(force=True)
        try:
            requests = self._requests(rows)
            for finished in generate(self.engine, requests, self.max_queued, self._stopping):
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
            self.samples.clear()

    def _requests(self, rows: Iterator[InputRow]) -> Iterator[Request]:
        """The requests of the input rows, the rows without one buffered as error rows."""
        while True:
            with self.stop.raising():  # waiting for the prefetch thread holds nothing
                row = next(rows, None)
            if row is None:
                return
            request = self._admit(*row)
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
        done = self.samples.add(row_index, request.sample_index, request.params.n, request)
        if done is not None:
            inputs = self.row_inputs.pop(row_index)
            self._add_row(inputs, [finished_row(r, self.reasoning) for r in done])

    def _add_row(self, inputs: pa.RecordBatch, rows: list[OutputRow]) -> None:
        """One input row's output rows to the sink, and counted in the live metrics."""
        self.sink.add_row(inputs, rows)
        if self.metrics is not None:
            self.metrics.add_rows(rows, self.sink.done_rows)

    def _report(self, force: bool = False) -> None:
        """Refresh the live metrics' engine-side figures (at most every REFRESH_SECONDS)."""
        if self.metrics is not None and (force or self.metrics.due()):
            progress = read_progress(self.sink, self.clock, self.engine, self.job_rows)
            self.metrics.refresh(progress)

    def _input_rows(self) -> Iterator[InputRow]:
        """Each selected row, its input columns, its values and its request (or why not),
        read and tokenized ahead on a background thread (with its own tokenizer), which also
        puts each schedule window of rows in admission order."""
        id_columns = [self.opened.id_column] if self.opened.id_column is not None else []

        def rows() -> Iterator[InputRow]:
            for batch in self.batches():
                row_indices = batch.row_indices.tolist()
                built = self.builder.build_batch(batch.batch, row_indices, id_columns)
                for i, (values, request) in enumerate(built):
                    yield row_indices[i], batch.batch.slice(i, 1), values, request

        ordered = windowed(
            rows(),
            window=self.window,
            max_len=self.engine.max_model_len,
            page_size=self.job.engine_config().page_size,
            request=lambda row: row[3] if isinstance(row[3], Request) else None,
        )
        return prefetch(ordered, depth=self.prefetch_rows)

    def _admit(
        self,
        row_index: int,
        inputs: pa.RecordBatch,
        values: dict[str, Any],
        request: Request | str,
    ) -> Request | None:
        """The request for the engine, or None: the row's error row goes to the sink."""
        if isinstance(request, Request):
            self.row_inputs[row_index] = inputs
            return request
        self.sink.log_error(row_index, values, request)
        self._add_row(inputs, error_rows(row_index, request, self.builder.output_rows(values)))
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
