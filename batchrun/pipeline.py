"""One job from start to end: check everything, then stream rows through the engine into parts.

Memory stays bounded: the input is read batch by batch, at most schedule_window rows are read
ahead to be admitted in a better order, at most QUEUE_FACTOR * max_batch_size requests wait in
the engine, and finished rows are written out every rows_per_part rows or part_seconds seconds.
An input row's output rows (its n samples) are written together, into one part: progress and
resume count input rows. SIGTERM and SIGINT stop a run cleanly (StopSignals): what is finished is
committed, and the next run of the same command does the rest.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.admission_order import windowed
from batchrun.engine.request import Request, round_tokens
from batchrun.errors import JobError, JobStopped, signal_name
from batchrun.io.fingerprint import job_fingerprint
from batchrun.io.output_dir import DAMAGED_DIR, PROGRESS_DIR, STATS_FILE, OutputDir
from batchrun.io.output_schema import (
    OutputRow,
    build_table,
    error_rows,
    finished_row,
)
from batchrun.io.part_writer import PartWriter
from batchrun.io.prefetch import prefetch
from batchrun.io.progress_bar import ProgressBar
from batchrun.io.prompts import (
    PromptColumn,
    RequestBuilder,
    find_id_column,
    find_prompt_column,
)
from batchrun.io.reader import InputSource, RowSelection, iter_batches, open_input
from batchrun.io.reasoning import reasoning_split
from batchrun.io.shards import shard_rows
from batchrun.job import JobSpec
from batchrun.sampling.grammar import Grammars
from batchrun.stats import STATS_COLUMNS, RunClock, StatsAccumulator, Timing

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchrun.parallel.group import TensorParallel

# An input row: its row_index, input columns, values of the columns read, request (or why not).
InputRow = tuple[int, pa.RecordBatch, dict[str, Any], Request | str]
QUEUE_FACTOR = 4  # requests queued in the engine, per unit of max_batch_size
PREFETCH_ROWS = 512  # input rows read and tokenized ahead of the engine
MAX_LOGGED_ERRORS = 10
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TP_STOP_CHECK_STEPS = 8  # tensor-parallel ranks agree on a stop every this many steps


class ErrorLog:
    """Error rows on the progress bar's log: the first MAX_LOGGED_ERRORS, then one line saying
    more follow (nothing when quiet)."""

    def __init__(self, bar: ProgressBar, quiet: bool, id_column: str | None) -> None:
        self.bar, self.quiet, self.id_column = bar, quiet, id_column
        self.count = 0

    def log(self, row_index: int, values: dict[str, Any], message: str) -> None:
        if self.quiet:
            return
        self.count += 1
        if self.count > MAX_LOGGED_ERRORS + 1:
            return
        if self.count > MAX_LOGGED_ERRORS:
            self.bar.log("batchrun: more error rows follow; see the output's error column")
            return
        name = f" ({self.id_column}={values[self.id_column]!r})" if self.id_column else ""
        self.bar.log(f"batchrun: row {row_index}{name}: {message}")


class EngineLike(Protocol):
    """What the pipeline needs of an engine (batchrun.engine.engine.Engine, or a test fake)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    max_model_len: int  # prompt + output tokens must fit
    vocab_size: int  # valid token ids: 0 <= id < vocab_size

    @property
    def block_size(self) -> int | None: ...  # DFlash block size; None without a draft

    @property
    def grammars(self) -> Grammars: ...  # structured outputs' compiler (made when first read)

    def info(self) -> dict[str, Any]: ...

    def add(self, request: Request) -> None: ...

    def step(self) -> list[Request]: ...

    @property
    def num_unfinished(self) -> int: ...


@dataclass(frozen=True)
class OpenedJob:
    """What the start-up checks found; nothing has been written yet."""

    job: JobSpec
    source: InputSource
    prompt: PromptColumn
    id_column: str | None
    schema: pa.Schema  # of every output part
    out: OutputDir
    fingerprint: dict[str, Any]

    @property
    def rows(self) -> range:
        """The row_index range this run covers: its shard's (whole row groups), or every row."""
        return shard_rows(self.source, self.job.shard_spec)


def open_job(job: JobSpec) -> OpenedJob:
    """Every check that needs no model: inputs, columns, output directory. Raises JobError."""
    for key in ("target", "draft"):
        model = getattr(job, key)
        if model is not None and not Path(model).is_dir():
            raise JobError(f"{key} model directory {model!r} does not exist")
    source = open_input(job.input, exclude=Path(job.output))
    prompt = find_prompt_column(source.schema, job)
    id_column = find_id_column(source.schema, job)
    schema = job.output_schema(source.schema)
    rows = shard_rows(source, job.shard_spec)
    out = OutputDir(Path(job.output), job.shard_spec, rows)
    fingerprint = job_fingerprint(job, source, prompt)
    out.check(fingerprint, job.overwrite)
    return OpenedJob(job, source, prompt, id_column, schema, out, fingerprint)


def build_engine(
    job: JobSpec,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tp: TensorParallel | None = None,
) -> EngineLike:
    """The job's engine (with tp, this rank's); `tokenizer`, when preflight has loaded it
    already, is not loaded again."""
    from batchrun.engine.engine import Engine  # the model stack loads only when a job runs

    return Engine(job.engine_config(), tokenizer, tp)


def generate(
    engine: EngineLike,
    requests: Iterator[Request],
    max_queued: int,
    stopping: Callable[[], bool] | None = None,
) -> Iterator[list[Request]]:
    """Feed `requests` to the engine, keeping at most max_queued unfinished, and step it until
    every one has finished; yields each step's finished requests (often none). stopping() is
    asked before each step: when it says so, generate returns at once, leaving the requests
    not finished in the engine (and those not yet read in `requests`)."""
    exhausted = False
    while True:
        if stopping is not None and stopping():
            return
        while not exhausted and engine.num_unfinished < max_queued:
            request = next(requests, None)
            if request is None:
                exhausted = True
            else:
                engine.add(request)
        if engine.num_unfinished == 0:
            return  # and the input is exhausted, else the queue would not be empty
        yield engine.step()


class StopSignals:
    """SIGTERM and SIGINT while run_job runs. Handlers are set in the main thread only (run_job
    elsewhere keeps the process's own), not for a signal that is ignored (SIGINT of a job started
    with `&`), and the ones found are put back after the run.

    Start-up (checks, claim, model loading) holds nothing to commit: a signal raises JobStopped
    where the main thread is. Once the run loop runs (defer()), the handler only records the
    signal, and the loop stops before its next step: it admits no more rows, drops the requests
    in flight (the next run redoes them), commits the rows finished so far, writes stats.json
    and raises JobStopped, which `batchrun run` prints as one line before it exits
    EXIT_STOPPED. While the loop waits for input rows (raising()), which holds nothing, a signal
    raises at once, so a slow read or tokenization never holds the stop up. A second signal ends
    the process at once (the default action): a part is committed by a rename, so no
    half-written part is left, its temp file is deleted by the next start, and the next run
    takes the claim of the dead process over.

    lockstep (tensor-parallel ranks): a signal is only recorded, in start-up too, and the ranks
    stop together at a step where one of them has one (_Run._stopping). Later signals are ignored:
    torchrun passes its signal on to ranks that the scheduler may have signalled already, and
    kills them itself after its shutdown timeout.
    """

    def __init__(self, lockstep: bool = False) -> None:
        self.signum: int | None = None
        self.lockstep = lockstep
        self._raises = not lockstep
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._install({s: signal.SIG_DFL if p is None else p for s, p in self._previous.items()})
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:  # a second signal that came while the first switched over
            if self.lockstep:
                return
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)  # its default action: the process ends here
        self.signum = signum
        then = signal.SIG_IGN if self.lockstep else signal.SIG_DFL
        self._install(dict.fromkeys(self._previous, then))
        if self._raises:
            raise JobStopped(signum)

    def _install(self, handlers: dict[int, Any]) -> None:
        """Sets handlers with their signals blocked: one that comes meanwhile is delivered to the
        new handler when they are unblocked. (Set unblocked, a signal that came between Python's
        check for pending signals and the switch would be dropped with an 'ignored due to race
        condition' traceback on stderr.)"""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, handlers)
        try:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def defer(self) -> None:
        """From now on a signal is only recorded: the run loop acts on it."""
        self._raises = False

    @contextlib.contextmanager
    def raising(self) -> Iterator[None]:
        """Within: a signal, or one recorded before, raises JobStopped (for waits that hold
        nothing). Not in lockstep: the ranks stop only where they agree."""
        if self.lockstep:
            yield
            return
        self._raises = True
        try:
            if self.signum is not None:
                raise JobStopped(self.signum)
            yield
        finally:
            self._raises = False


def stop_line(signum: int, committed: int, this_run: int, left: int, overwrite: bool) -> str:
    """What `batchrun run` prints on stderr when a signal stopped it (rows: input rows of the
    job, or of its shard). The same command resumes, unless it overwrites."""
    again = "with --no-overwrite" if overwrite else "again"
    return (
        f"batchrun: stopped by {signal_name(signum)}: {committed} rows committed "
        f"({this_run} in this run), {left} left for the next run; "
        f"run the same command {again} to resume"
    )


def _committed_rows(opened: OpenedJob) -> int:
    """The rows of this run's range (its shard's, or every row) in committed parts."""
    rows = opened.rows
    return int(opened.out.done_mask(opened.source.total_rows)[rows.start : rows.stop].sum())


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
            opened = open_job(job)
            return _run_job(job, opened, clock, engine, tp, stop)
        except JobStopped as exc:
            if exc.line is not None or tp is not None:
                raise
            # Stopped in start-up: nothing was generated; say what earlier runs committed.
            line = f"batchrun: stopped by {signal_name(exc.signum)} before the job started; "
            line += "run the same command again to start it"
            if opened is not None:
                with contextlib.suppress(Exception):
                    committed = _committed_rows(opened)
                    left = len(opened.rows) - committed
                    line = stop_line(exc.signum, committed, 0, left, job.overwrite)
            raise JobStopped(exc.signum, line) from None


def _run_job(
    job: JobSpec,
    opened: OpenedJob,
    clock: RunClock,
    engine: EngineLike | None,
    tp: TensorParallel | None,
    stop: StopSignals,
) -> dict[str, Any]:
    leads = tp is None or tp.rank == 0
    found = None
    if engine is None:
        from batchrun.preflight import preflight  # needs transformers, as the engine does

        found = preflight(job, opened.prompt)  # what validate checks, before any weights load
    if leads:
        opened.out.acquire()  # before loading the model: a second run stops at once
    try:
        if engine is None:
            engine = build_engine(job, found.tokenizer if found is not None else None, tp)
        clock.engine_ready()  # tokens/s counts generation only, not start-up and model loading
        builder = RequestBuilder(
            job,
            opened.prompt,
            opened.source.schema,
            copy.deepcopy(engine.tokenizer),  # used on the prefetch thread only
            engine.max_model_len,
            engine.vocab_size,
            lambda: engine.grammars,
        )
        damaged = opened.out.prepare(opened.fingerprint, job.overwrite) if leads else []
        if damaged:
            print(
                f"batchrun: warning: {len(damaged)} damaged part(s) moved to "
                f"{PROGRESS_DIR}/{DAMAGED_DIR}/ ({', '.join(damaged)}); their rows are redone",
                file=sys.stderr,
            )
        if tp is not None:
            tp.barrier()  # rank 0 has prepared the output: every rank may read it
        run = _Run(opened, engine, builder, clock, writes=leads, stop=stop, tp=tp)
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


class _Run:
    def __init__(
        self,
        opened: OpenedJob,
        engine: EngineLike,
        builder: RequestBuilder,
        clock: RunClock,
        writes: bool = True,
        stop: StopSignals | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """writes=False: a tensor-parallel rank other than 0, which runs the engine in step
        with rank 0 but writes nothing (no parts, stats, progress bar or error log). stop: the
        signals that stop the run early (None: none do); tp: the group whose ranks must agree
        on a stop."""
        self.job, self.out, self.engine, self.builder = opened.job, opened.out, engine, builder
        self.reasoning = reasoning_split(self.job, engine.tokenizer)
        self.writes = writes
        self.stop = stop if stop is not None else StopSignals()
        self.tp = tp
        self.steps = 0
        self.stopped = False  # by a signal, with rows left
        self.opened = opened
        self.clock = clock
        rows = opened.rows
        self.selection = RowSelection(self.out.done_mask(opened.source.total_rows), rows)
        self.job_rows = len(rows)
        self.stats = StatsAccumulator()  # unsharded: every committed row, other shards' too
        for part in self.out.stats_parts():
            self.stats.add(pq.read_table(part, columns=STATS_COLUMNS))
        self.done_rows = self.job_rows - self.selection.count()  # committed plus buffered
        self.committed_before = self.done_rows  # by earlier runs
        # row_index -> its input columns and its samples finished so far
        self.pending: dict[int, tuple[pa.RecordBatch, list[Request]]] = {}
        self.writer = PartWriter(
            self.out, opened.schema, self.job.rows_per_part, self.job.part_seconds, self._committed
        )
        self.run_tokens = 0  # generated in this run, for tokens/s
        self.run_spec_tokens = 0
        self.run_spec_rounds = 0
        quiet = self.job.quiet or not writes
        self.bar = ProgressBar(self.job_rows, enabled=not quiet)
        self.error_log = ErrorLog(self.bar, quiet, opened.id_column)

    def execute(self) -> dict[str, Any]:
        try:
            self._loop()
            self.writer.flush()
        except BaseException:
            with contextlib.suppress(Exception):
                self.writer.flush()  # finished rows are good output whatever stopped the job
            raise
        finally:
            self.writer.close()
            self.bar.close()
        return self._finish()

    def _loop(self) -> None:
        rows = self._input_rows()
        max_queued = QUEUE_FACTOR * self.job.max_batch_size
        try:
            requests = self._requests(rows)
            for finished in generate(self.engine, requests, max_queued, self._stopping):
                for request in finished:
                    self._collect(request)
                self.writer.maybe_commit()
        except JobStopped:  # a signal while waiting for input rows
            self.stopped = True
        finally:
            close = getattr(rows, "close", None)
            if close is not None:
                close()  # the prefetch thread stops at its next row (a daemon: never waited for)
        if self.stopped:
            # The requests in flight are dropped, and the rows of which only some samples have
            # finished (never buffered: a part holds all of a row's output rows or none).
            abort = getattr(self.engine, "abort_all", None)
            if abort is not None:
                abort()
            self.pending.clear()

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
        """A finished sample; with the row's last one, the row's output rows are buffered."""
        self._count(request)
        inputs, done = self.pending[request.row_index]
        if request.error is not None and request.sample_index == 0:  # its grammar's, say
            self.error_log.log(request.row_index, inputs.to_pylist()[0], request.error)
        done.append(request)
        if len(done) == request.params.n:
            del self.pending[request.row_index]
            done.sort(key=lambda r: r.sample_index)
            self._buffer(inputs, [finished_row(r, self.reasoning) for r in done])

    def _input_rows(self) -> Iterator[InputRow]:
        """Each selected row, its input columns, its values and its request (or why not),
        read and tokenized ahead on a background thread (with its own tokenizer), which also
        puts each schedule window of rows in admission order."""
        id_columns = [self.opened.id_column] if self.opened.id_column is not None else []

        def rows() -> Iterator[InputRow]:
            for batch in iter_batches(self.opened.source, self.selection):
                row_indices = batch.row_indices.tolist()
                built = self.builder.build_batch(batch.batch, row_indices, id_columns)
                for i, (values, request) in enumerate(built):
                    yield row_indices[i], batch.batch.slice(i, 1), values, request

        ordered = windowed(
            rows(),
            window=self.job.schedule_window,
            max_len=self.engine.max_model_len,
            page_size=self.job.engine_config().page_size,
            request=lambda row: row[3] if isinstance(row[3], Request) else None,
        )
        return prefetch(ordered, depth=PREFETCH_ROWS)

    def _admit(
        self,
        row_index: int,
        inputs: pa.RecordBatch,
        values: dict[str, Any],
        request: Request | str,
    ) -> Request | None:
        """The request for the engine, or None: the row's error row is buffered."""
        if isinstance(request, Request):
            self.pending[row_index] = (inputs, [])
            return request
        self.error_log.log(row_index, values, request)
        self._buffer(inputs, error_rows(row_index, request, self.builder.output_rows(values)))
        self.writer.maybe_commit()
        return None

    def _count(self, request: Request) -> None:
        self.run_tokens += len(request.output_ids)
        if request.spec_hist is not None:  # the tokens of its speculation rounds
            self.run_spec_tokens += round_tokens(request.spec_hist)
            self.run_spec_rounds += request.spec_rounds

    def _buffer(self, inputs: pa.RecordBatch, rows: list[OutputRow]) -> None:
        """An input row's output rows, all at once (a part never splits them)."""
        for row in rows if self.writes else ():
            self.writer.add(inputs, row)
        self.done_rows += 1
        self._draw()

    def _committed(self, table: pa.Table) -> None:
        """After each part (on the writer thread): its rows count, stats.json is rewritten."""
        self.stats.add(table)
        self.out.write_json(self.out.stats_path, self._stats())

    def _draw(self) -> None:
        tau = self.run_spec_tokens / self.run_spec_rounds if self.run_spec_rounds else None
        self.bar.update(self.done_rows, self.run_tokens, tau)

    def _stats(self) -> dict[str, Any]:
        return self.stats.to_dict(
            info=self.engine.info(),
            block_size=self.engine.block_size,
            timing=self.clock.timing(),
            run_completion_tokens=self.run_tokens,
            extra={"input_rows": self.job_rows, "shard": self.job.shard},
        )

    def _finish(self) -> dict[str, Any]:
        # The ranks of a group have buffered the same rows: they agree on whether rows are left.
        stopped = self.stopped and self.done_rows < self.job_rows
        signum = self.stop.signum or signal.SIGTERM  # a rank stopped by another's signal
        if not self.writes:
            if stopped:
                raise JobStopped(signum)  # rank 0 speaks
            return self._stats()
        if self.job_rows == 0 and not self.out.own_parts():
            # A zero-row job (or shard) still leaves a part: readers find the output schema.
            self.out.commit(build_table(self.opened.schema, [], []))
        stats = self._stats()
        self.out.write_json(self.out.stats_path, stats)
        if self.out.done_mask(self.opened.source.total_rows).all():
            if self.job.shard is not None:
                self._write_job_wide_stats()
            self.out.mark_success()  # last: every input row has its output row
        if stopped:
            committed = _committed_rows(self.opened)
            this_run = committed - self.committed_before
            raise JobStopped(
                signum,
                stop_line(
                    signum, committed, this_run, self.job_rows - committed, self.job.overwrite
                ),
            )
        return stats

    def _write_job_wide_stats(self) -> None:
        """The last shard to finish writes stats.json over every shard's parts."""
        totals = StatsAccumulator()
        for part in self.out.committed_parts():
            totals.add(pq.read_table(part, columns=STATS_COLUMNS))
        stats = totals.to_dict(
            info=self.engine.info(),
            block_size=self.engine.block_size,
            timing=Timing.longest(self.out.shard_timings()),  # shards run side by side
            run_completion_tokens=totals.completion_tokens,
            extra={"input_rows": self.opened.source.total_rows, "shard": None},
        )
        self.out.write_json(self.out.path / STATS_FILE, stats)
