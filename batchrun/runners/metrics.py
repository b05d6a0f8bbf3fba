"""Live Prometheus metrics of a running job (--metrics-port, --metrics-file): what the run loop
already counts, published on a registry of the job's own.

The run loop feeds it: each input row's output rows as they go to the sink (`add_rows`) and, at most
every REFRESH_SECONDS after an engine step, a `Progress` read from the sink, the clock and the
engine (`refresh`). Nothing is read from another thread: the HTTP server and the textfile thread
only read the registry, which prometheus_client locks. Every metric carries a `worker` label, the
process's shard index ("0" unsharded), so the series of several processes stay apart where one
Prometheus collects them.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    start_http_server,
    write_to_textfile,
)

from batchrun.config.job import JobSpec
from batchrun.errors import JobError
from batchrun.io.local_paths import unmakeable
from batchrun.io.output.columns import OutputRow
from batchrun.io.output.sink import OutputSink
from batchrun.io.output.stats import RunClock
from batchrun.runners.engine_feed import EngineLike

REFRESH_SECONDS = 0.5  # engine-side figures are read at most this often
FILE_SECONDS = 5.0  # the textfile is rewritten this often while the job runs
MAX_PORT = 65535


@dataclass(frozen=True)
class Progress:
    """What the run loop knows now: this process's input rows (its RowShare: all, and done
    including earlier runs), this run's generated tokens over its generation seconds, its
    speculation rounds and the tokens they committed, the engine's steps by kind and by verify
    width (cumulative over the job), and its KV pages in use and in all (None: an engine
    without a page pool)."""

    input_rows: int
    input_rows_done: int
    generated_tokens: int
    generation_seconds: float
    spec_rounds: int
    spec_tokens: int
    steps: Mapping[str, int]
    width_steps: Mapping[int, int] | None
    kv_pages: tuple[int, int] | None


@dataclass(frozen=True)
class RowShare:
    """The input rows a process's metrics report, cut so that their sums over `worker` are the
    job's: a shard's rows (or every row, unsharded), or a --workers worker's share: the rows of
    the chunks it takes first (the workers' shares cut the job's rows). done_before: of those,
    the rows done when it started; the rows it finishes are added (a worker that takes chunks
    over from another may pass its share, the other then stays below its own)."""

    rows: int
    done_before: int

    def done(self, sink: OutputSink) -> int:
        return self.done_before + sink.done_rows - sink.committed_before


def read_progress(
    sink: OutputSink, clock: RunClock, engine: EngineLike, share: RowShare
) -> Progress:
    """The Progress of a run loop: its sink's counts, its clock, its engine's info() and page
    pool (the real engine's; a test's fake may have none)."""
    info = engine.info()
    pool = getattr(engine, "pool", None)
    pages = None
    if pool is not None:  # idle cached pages are free to take: in use means held
        pages = (pool.num_pages - pool.num_free, pool.num_pages)
    return Progress(
        input_rows=share.rows,
        input_rows_done=share.done(sink),
        generated_tokens=sink.run_tokens,
        generation_seconds=clock.timing().generation_seconds,
        spec_rounds=sink.run_spec_rounds,
        spec_tokens=sink.run_spec_tokens,
        steps=info.get("steps") or {},
        width_steps=info.get("verify_width_steps"),
        kv_pages=pages,
    )


class JobMetrics:
    """The registry of one job's metrics, and the figures the run loop feeds into it."""

    def __init__(self, worker: str, refresh_seconds: float = REFRESH_SECONDS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.worker, self.refresh_seconds = worker, refresh_seconds
        self._last_refresh = float("-inf")
        self._steps: dict[str, int] = {}  # cumulative counts already added to the counters
        self._width_steps: dict[int, int] = {}
        self._spec = (0, 0)
        labels = ["worker"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        self.rows = counter("batchrun_rows", "Output rows written by this run, error rows too.")
        self.error_rows = counter("batchrun_error_rows", "Output rows with an error.")
        self.prompt_tokens = counter("batchrun_prompt_tokens", "Prompt tokens of ok rows.")
        self.completion_tokens = counter(
            "batchrun_completion_tokens", "Completion tokens of ok rows."
        )
        self.input_rows = gauge(
            "batchrun_input_rows", "Input rows this process covers (its shard's or worker's share)."
        )
        self.input_rows_done = gauge(
            "batchrun_input_rows_done", "Of those, rows with output (earlier runs' included)."
        )
        self.tokens_per_second = gauge(
            "batchrun_output_tokens_per_second",
            "Tokens generated by this run per second of generation (as stats.json).",
        )
        self.steps = counter("batchrun_steps", "Engine steps by kind.", ("kind",))
        self.spec_rounds = counter("batchrun_spec_rounds", "Verify rounds of finished rows.")
        self.spec_tokens = counter(
            "batchrun_spec_tokens", "Tokens committed by the verify rounds of finished rows."
        )
        self.acceptance_length = gauge(
            "batchrun_acceptance_length", "Tokens committed per verify round (tau), this run."
        )
        self.width_steps = counter(
            "batchrun_verify_width_steps", "Engine steps by verify width.", ("width",)
        )
        self.kv_pages_used = gauge("batchrun_kv_pages_used", "KV pages held by requests.")
        self.kv_pages_total = gauge("batchrun_kv_pages_total", "KV pages in the pool.")
        for kind in ("prefill", "mixed", "decode"):  # each kind's series exists from the start
            self.steps.labels(worker, kind)
        for family in (self.rows, self.error_rows, self.prompt_tokens, self.completion_tokens):
            family.labels(worker)

    def add_rows(self, rows: list[OutputRow], input_rows_done: int) -> None:
        """One input row's output rows, as they go to the sink (tokens: ok rows', as stats.json),
        and the input rows done with it."""
        ok = [row for row in rows if row.error is None]
        self.input_rows_done.labels(self.worker).set(input_rows_done)
        self.rows.labels(self.worker).inc(len(rows))
        self.error_rows.labels(self.worker).inc(len(rows) - len(ok))
        self.prompt_tokens.labels(self.worker).inc(sum(row.prompt_tokens for row in ok))
        self.completion_tokens.labels(self.worker).inc(sum(row.completion_tokens for row in ok))

    def due(self) -> bool:
        """Whether REFRESH_SECONDS have passed since the last refresh."""
        return time.monotonic() - self._last_refresh >= self.refresh_seconds

    def refresh(self, progress: Progress) -> None:
        self._last_refresh = time.monotonic()
        worker = self.worker
        self.input_rows.labels(worker).set(progress.input_rows)
        self.input_rows_done.labels(worker).set(progress.input_rows_done)
        if progress.generation_seconds > 0:
            rate = progress.generated_tokens / progress.generation_seconds
            self.tokens_per_second.labels(worker).set(rate)
        _advance(self.steps, worker, self._steps, progress.steps)
        if progress.width_steps is not None:
            _advance(self.width_steps, worker, self._width_steps, progress.width_steps)
        rounds, tokens = progress.spec_rounds, progress.spec_tokens
        if rounds:  # a drafter runs: its series appear with its first finished rounds
            self.spec_rounds.labels(worker).inc(max(0, rounds - self._spec[0]))
            self.spec_tokens.labels(worker).inc(max(0, tokens - self._spec[1]))
            self.acceptance_length.labels(worker).set(tokens / rounds)
        self._spec = (rounds, tokens)
        if progress.kv_pages is not None:
            self.kv_pages_used.labels(worker).set(progress.kv_pages[0])
            self.kv_pages_total.labels(worker).set(progress.kv_pages[1])


def _advance(family: Counter, worker: str, seen: dict[Any, int], totals: Mapping[Any, int]) -> None:
    """Add to each label's counter what its cumulative total grew by since last seen."""
    for key, total in totals.items():
        grown = total - seen.get(key, 0)
        if grown > 0:
            family.labels(worker, str(key)).inc(grown)
        seen[key] = total


@dataclass(frozen=True)
class MetricsPlan:
    """Where one process publishes: its worker label, its port (None: none) on host, and its
    textfile (None: none)."""

    worker: str
    host: str
    port: int | None
    file: Path | None

    @classmethod
    def of(cls, job: JobSpec, worker: int | None = None) -> MetricsPlan | None:
        """The job's plan (None: no metrics asked for). Shard I of N (or worker I: a process
        of several that share the job's rows without shards) serves on port + I and writes
        NAME-I.prom, so the processes of one node do not collide."""
        run = job.run
        if run.metrics_port is None and run.metrics_file is None:
            return None
        index = worker if worker is not None else run.shard_spec[0] if run.shard_spec else None
        port, file = run.metrics_port, Path(run.metrics_file) if run.metrics_file else None
        if port is not None and index is not None:
            port += index
            if port > MAX_PORT:
                raise JobError(
                    f"metrics port {run.metrics_port} + worker {index} is above {MAX_PORT}"
                )
        if file is not None and index is not None:
            file = file.with_name(f"{file.stem}-{index}{file.suffix}")
        return cls(str(index or 0), run.metrics_host, port, file)


def node_plans(job: JobSpec) -> list[MetricsPlan]:
    """The plans of the processes a run starts on this node: each worker's with --workers N,
    else its own (none where no metrics are asked for). JobError for a port past MAX_PORT."""
    workers = job.run.workers
    indices: list[int | None] = list(range(workers)) if workers > 1 else [None]
    plans = [MetricsPlan.of(job, worker=index) for index in indices]
    return [plan for plan in plans if plan is not None]


def check_plan(plan: MetricsPlan) -> None:
    """The refusals `published` would meet, made before anything starts (validate makes them
    too): the host resolves, the port binds (for a moment), the textfile's directory can be
    made and written in and the file is no directory. Writes nothing. Raises JobError."""
    if plan.port is not None:
        try:
            family, _, _, _, address = socket.getaddrinfo(
                plan.host, plan.port, type=socket.SOCK_STREAM
            )[0]
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # As the server binds (http.server's allow_reuse_address): a port in TIME_WAIT
                # binds, one that a process listens on does not.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            raise _port_error(exc, plan.host, plan.port) from None
    if plan.file is not None:
        _check_file(plan.file)


def _port_error(exc: OSError, host: str, port: int) -> JobError:
    if isinstance(exc, socket.gaierror):
        return JobError(f"metrics host {host!r} does not resolve: {_why(exc)}")
    reason = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {_why(exc)}"
    return JobError(f"metrics port {port} on {host} {reason}")


def _check_file(path: Path) -> None:
    problem = "it is a directory" if path.is_dir() else unmakeable(path.parent)
    if problem is not None:
        raise JobError(f"metrics file {str(path)!r} cannot be written: {problem}")


@contextlib.contextmanager
def published(plan: MetricsPlan | None) -> Iterator[JobMetrics | None]:
    """Within: the job's metrics served on the plan's port and written to its textfile every
    FILE_SECONDS; on the way out (also on failure) the textfile is written once more and the
    server stops. A port that cannot be bound or a file that cannot be written: JobError before
    anything else starts, in check_plan's words."""
    if plan is None:
        yield None
        return
    metrics = JobMetrics(plan.worker, REFRESH_SECONDS)
    with contextlib.ExitStack() as stack:
        if plan.port is not None:
            stack.enter_context(_served(metrics.registry, plan.host, plan.port))
        if plan.file is not None:
            stack.enter_context(_textfile(metrics.registry, plan.file))
        yield metrics


@contextlib.contextmanager
def _served(registry: CollectorRegistry, host: str, port: int) -> Iterator[None]:
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise _port_error(exc, host, port) from None
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def _textfile(registry: CollectorRegistry, path: Path) -> Iterator[None]:
    _check_file(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JobError(
            f"metrics file {str(path)!r} cannot be written: its directory "
            f"{str(path.parent)!r} cannot be made ({_why(exc)})"
        ) from None
    try:
        write_to_textfile(str(path), registry)  # the first write is the check
    except OSError as exc:
        raise JobError(f"metrics file {str(path)!r} cannot be written: {_why(exc)}") from None
    stop = threading.Event()
    writer = threading.Thread(
        target=_rewrite, args=(registry, path, stop), name="batchrun-metrics-file", daemon=True
    )
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()
        with contextlib.suppress(OSError):  # the run's own outcome matters more
            write_to_textfile(str(path), registry)


def _rewrite(registry: CollectorRegistry, path: Path, stop: threading.Event) -> None:
    """Rewrite the textfile every FILE_SECONDS until stopped; a failed write is said once."""
    warned = False
    while not stop.wait(FILE_SECONDS):
        try:
            write_to_textfile(str(path), registry)
        except OSError as exc:
            if not warned:
                line = f"batchrun: warning: metrics file {str(path)!r}: {_why(exc)}"
                print(line, file=sys.stderr)
                warned = True


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)
