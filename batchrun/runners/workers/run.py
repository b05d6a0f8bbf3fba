"""`batchrun run --workers N`: N worker processes on this node, one per GPU (or N on the CPU),
sharing one output.

The parent (this process) makes validate's start-up checks (batchrun.runners.startup: every
worker's metrics port and file too), claims the output and prepares it as a single run does,
then starts the workers (batchrun.runners.workers.worker). They pull chunks of row groups through
claims as they need rows (batchrun.runners.workers.chunks): no fixed shards, so a slow worker takes
less. Each commits parts of its own name (those of shard I of N); the parent draws one progress bar
from their reports and, once every row is committed, ends the job through the output sink
(batchrun.io.output.sink), as every runner does. A worker killed mid-job leaves claims that are
stale at once on this host (its process is gone): the workers still reading take its chunks over,
and when all have ended with rows left, the parent starts another round of workers for them (as
long as a round commits rows). A worker's error stops the others and the job, in one line. SIGTERM
or SIGINT (to the parent, or to its process group: the workers run in sessions of their own)
stop every worker once, cleanly (what is finished is committed), and the job ends as a single
run's does: stats.json for what was committed, one line, EXIT_STOPPED."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from batchrun.config.job import JobSpec
from batchrun.errors import EXIT_STOPPED, JobError, JobStopped, signal_name
from batchrun.io.output.directory import OutputDir
from batchrun.io.output.progress_bar import ProgressBar
from batchrun.io.output.sink import Finished, OutputSink, RunFacts
from batchrun.io.output.stats import RunClock, Timing
from batchrun.io.parts import STATS_FILE, is_temp
from batchrun.runners.metrics import RowShare
from batchrun.runners.opened_job import OpenedJob
from batchrun.runners.startup import check_start, start_up_stop
from batchrun.runners.stop_signals import StopSignals, stop_line
from batchrun.runners.workers.chunks import Chunk, chunk_rows, home_share, plan_chunks
from batchrun.runners.workers.worker import WorkerTask

POLL_SECONDS = 0.2


@dataclass
class _Worker:
    """A worker process the parent started, and what it reported."""

    index: int
    device: str
    process: subprocess.Popen[bytes]
    conn: Connection | None
    tokens: tuple[int, int, int] = (0, 0, 0)  # completion tokens, speculated tokens, rounds
    rows: int = 0  # input rows it finished (reported)
    error: str | None = None
    report: dict[str, Any] | None = None
    told: bool = False  # how it ended was said


@dataclass
class _Job:
    """The parent's view of the run: the workers of every round and the job's progress bar."""

    opened: OpenedJob
    devices: list[str]
    bar: ProgressBar
    committed_before: int
    workers: list[_Worker] = field(default_factory=list)

    def draw(self, force: bool = False) -> None:
        rows = min(self.committed_before + sum(w.rows for w in self.workers), self.bar.total)
        tokens = sum(w.tokens[0] for w in self.workers)
        spec, rounds = (sum(w.tokens[i] for w in self.workers) for i in (1, 2))
        self.bar.update(rows, tokens, spec / rounds if rounds else None, force)


def run_workers(job: JobSpec) -> dict[str, Any]:
    """Run the job with job.run.workers processes; returns its stats.json content. Raises
    JobStopped (with its line) when SIGTERM or SIGINT stopped it, after writing stats.json for
    what was committed, JobError when a worker failed or rows are left that no round of workers
    could do."""
    clock = RunClock()
    opened: OpenedJob | None = None
    with StopSignals() as stop:
        try:
            checked = check_start(job)  # every worker's port and file too, before any starts
            opened = checked.opened
            assert checked.devices is not None  # workers > 1
            return _run(checked.opened, checked.devices, stop, clock)
        except JobStopped as exc:
            if exc.line is not None:
                raise
            raise start_up_stop(exc, job, opened) from None


def _run(
    opened: OpenedJob, devices: list[str], stop: StopSignals, clock: RunClock
) -> dict[str, Any]:
    out, job = opened.out, opened.job
    out.acquire()
    try:
        opened.prepare_output()
        total = opened.source.total_rows
        committed = int(out.done_mask(total).sum())
        bar = ProgressBar(total, enabled=not job.run.quiet)
        state = _Job(opened, devices, bar, committed)
        try:
            if committed == total and out.complete():
                existing = _existing_stats(out)
                if existing is not None:
                    return existing  # a second run adds nothing
            stop.defer()
            _rounds(state, stop)
        finally:
            bar.close()
        finished = _finish(state, clock)  # stats.json; _SUCCESS once every row is committed
        if stop.signum is not None and finished.missing_rows:
            now = finished.committed_rows
            line = stop_line(stop.signum, now, now - committed, total - now, job.output.overwrite)
            raise JobStopped(stop.signum, line)
        return finished.stats
    finally:
        out.release()


def _rounds(state: _Job, stop: StopSignals) -> None:
    """Rounds of workers until every row is committed or a signal stopped them; raises when a
    worker failed or rows are left that no round could do."""
    out, total = state.opened.out, state.opened.source.total_rows
    committed = state.committed_before
    first = True
    while first or committed < total:
        size = chunk_rows(total, len(state.devices))
        chunks = plan_chunks(state.opened.source, size)
        done = out.done_mask(total)
        left = sum(1 for c in chunks if not done[c.start : c.stop].all())
        count = max(1, min(len(state.devices), left))
        started = [_start(state, index, count, chunks, size, done) for index in range(count)]
        state.workers += started
        _watch(state, started, stop)
        if stop.signum is not None:
            return
        now = int(out.done_mask(total).sum())
        failed = [w for w in started if w.error is not None]
        if failed:
            raise JobError(f"worker {failed[0].index}: {failed[0].error}")
        if now < total and now == committed and not first:
            raise JobError(
                f"{total - now} rows are left after a round of workers committed none; "
                "run the same command again to resume"
            )
        committed, first = now, False


def _start(
    state: _Job, index: int, count: int, chunks: list[Chunk], size: int, done: np.ndarray
) -> _Worker:
    job = state.opened.job
    device = state.devices[index]
    worker_job = dataclasses.replace(
        job,
        engine=dataclasses.replace(job.engine, device=device),
        output=dataclasses.replace(job.output, overwrite=False),  # the parent has prepared it
    )
    share = RowShare(*home_share(chunks, index, count, done))  # one mask for the round's
    task = WorkerTask(worker_job, index, count, tuple(chunks), size, os.getpid(), share)
    ours, theirs = socket.socketpair()
    env = dict(os.environ)  # the node's cores shared among the workers, as torchrun's ranks do
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // count)))
    # In a session of its own, so that a terminal's Ctrl-C (a signal to the process group)
    # reaches this process only, which stops each worker once (_watch): a worker's second
    # signal would end it at once (StopSignals).
    process = subprocess.Popen(
        [sys.executable, "-m", "batchrun.runners.workers.worker", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(task)
    state.bar.log(f"batchrun: worker {index}/{count} (pid {process.pid}) on {device}")
    return _Worker(index, device, process, conn)


def _watch(state: _Job, workers: list[_Worker], stop: StopSignals) -> None:
    """Relay the workers' reports until each has ended. On a signal or a worker's error, each
    is sent SIGTERM once: it commits what it finished (one still importing ends at once, and
    silently, which SIGINT's KeyboardInterrupt would not)."""
    signalled = False
    while True:
        open_conns = [w.conn for w in workers if w.conn is not None]
        for conn in wait(open_conns, timeout=POLL_SECONDS) if open_conns else ():
            worker = next(w for w in workers if w.conn is conn)
            _receive(state, worker)
        if not open_conns:
            time.sleep(POLL_SECONDS)
        state.draw()
        ended = [w for w in workers if w.process.poll() is not None]
        for worker in ended:
            _ended(state, worker, stopped=stop.signum is not None)
        stopping = stop.signum is not None or any(w.error is not None for w in workers)
        if stopping and not signalled:
            signalled = True
            for worker in workers:
                if worker.process.poll() is None:
                    worker.process.send_signal(signal.SIGTERM)
        if len(ended) == len(workers) and all(w.conn is None for w in workers):
            state.draw(force=True)
            return


def _receive(state: _Job, worker: _Worker) -> None:
    assert worker.conn is not None
    try:
        message = worker.conn.recv()
    except (EOFError, OSError):  # it ended (or was killed)
        worker.conn.close()
        worker.conn = None
        return
    kind = message[0]
    if kind == "progress":
        worker.rows += message[1]
        worker.tokens = tuple(message[2:5])
    elif kind == "log":
        state.bar.log(message[1])
    elif kind == "error":
        worker.error = message[1]
    elif kind == "done":
        worker.report = message[1]


def _ended(state: _Job, worker: _Worker, stopped: bool) -> None:
    """Say once how a worker ended, unless it ended well or a signal stops the job (its rows
    are the next run's, not taken over)."""
    status = worker.process.returncode
    if worker.told or status in (0, EXIT_STOPPED):
        return
    worker.told = True
    pid = worker.process.pid
    if status < 0 and stopped:
        return
    if status < 0:
        state.bar.log(
            f"batchrun: worker {worker.index} (pid {pid}) was killed by "
            f"{signal_name(-status)}; its rows are taken over"
        )
    elif worker.error is None:
        worker.error = f"exited with status {status} (pid {pid}); see its messages above"


def _existing_stats(out: OutputDir) -> dict[str, Any] | None:
    try:
        data = json.loads(out.store.read_text(out.path / STATS_FILE))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "rows" in data else None


def _finish(state: _Job, clock: RunClock) -> Finished:
    """Every worker has ended: the job ends through the output sink (stats.json over every
    part, with the workers' tokens and timing; _SUCCESS once every row is committed), as a
    single run does, also when a signal stopped it; then the workers' temps and chunk claims
    go."""
    opened = state.opened
    reports = [w.report for w in state.workers if w.report is not None]
    worker_timing = Timing.longest([Timing(*r["timing"]) for r in reports])

    def facts() -> RunFacts:
        wall = clock.timing().wall_seconds
        return RunFacts(
            info=_job_info([r["info"] for r in reports], state.devices),
            block_size=reports[0]["block_size"] if reports else None,
            extra={
                "input_rows": opened.source.total_rows,
                "shard": None,
                "workers": len(state.devices),
            },
            timing=Timing(wall, worker_timing.load_seconds, worker_timing.generation_seconds),
        )

    # Made now: its statistics are those of every part committed, by every worker.
    sink = OutputSink(opened.sink_target(quiet=True), clock=clock, facts=facts)
    with sink.writing():
        for report in reports:
            sink.count(report["run_tokens"], None, 0)
    finished = sink.finish()
    _clean_up(opened.out)
    return finished


def _job_info(infos: list[Mapping[str, Any]], devices: list[str]) -> dict[str, Any]:
    """The engine facts of the job: the first worker's, with every worker's devices and steps."""
    if not infos:
        return {}
    info = dict(infos[0])
    info["device"] = ",".join(dict.fromkeys(devices))
    steps: dict[str, int] = {}
    for one in infos:
        for kind, count in (one.get("steps") or {}).items():
            steps[kind] = steps.get(kind, 0) + count
    if infos[0].get("steps") is not None:
        info["steps"] = steps
    return info


def _clean_up(out: OutputDir) -> None:
    """The temps of killed workers' unfinished parts and the chunk claims (every worker ended)."""
    if out.store.local:
        for directory in (out.path, out.progress):
            for entry in out.store.glob(directory, "*"):
                if is_temp(entry.name):
                    out.store.remove(entry)
    with contextlib.suppress(OSError):
        out.chunk_claims().remove_all()
