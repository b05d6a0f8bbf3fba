"""One worker of a multi-worker job (batchrun.runners.workers.run): a process of its own, started as
`python -m batchrun.runners.workers.worker FD`, FD one end of a socket pair to its parent.

It receives its WorkerTask, loads the model on its device, and runs the job's run loop over the
chunks it claims (batchrun.runners.workers.chunks), committing parts of its own name (those of
shard I of N) into the shared output. Its parent holds the output's claim and ends the job (the
output sink's finish): the worker sends its progress, its error rows' lines and, at the end, its
engine's facts. It dies with its parent (a worker whose parent is gone commits nothing more)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from batchrun.config.job import JobSpec
from batchrun.errors import EXIT_STOPPED, JobError, JobStopped
from batchrun.io.output.directory import OutputDir
from batchrun.io.output.progress_bar import ProgressBar
from batchrun.io.output.sink import OutputSink
from batchrun.io.output.stats import RunClock
from batchrun.runners.engine_feed import build_engine
from batchrun.runners.local import LocalRun
from batchrun.runners.metrics import MetricsPlan, RowShare, published
from batchrun.runners.opened_job import open_job
from batchrun.runners.row_pipeline import Pace, request_builder
from batchrun.runners.stop_signals import StopSignals
from batchrun.runners.workers.chunks import Chunk, ChunkPuller

PROGRESS_SECONDS = 0.2
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerTask:
    """What the parent gives worker `index` of `count`: the job (its device set, overwrite off:
    the parent has prepared the output) and the chunks every worker plans alike."""

    job: JobSpec
    index: int
    count: int
    chunks: tuple[Chunk, ...]
    chunk_rows: int
    parent_pid: int
    share: RowShare  # what its metrics report (the workers' shares sum to the job's rows)


class PipeBar(ProgressBar):
    """In place of the sink's progress bar: the rows this worker finished and its tokens go to
    the parent (which draws one bar for the job), as do the error rows' lines."""

    def __init__(self, conn: Connection, sink: OutputSink) -> None:
        super().__init__(sink.bar.total, enabled=False)
        self.conn, self.sink = conn, sink
        self.sent = sink.done_rows  # rows committed before: counted by the parent already
        self.last = 0.0

    def update(self, done: int, tokens: int, tau: float | None, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= PROGRESS_SECONDS:
            self._send(done)

    def log(self, message: str) -> None:
        self.conn.send(("log", message))

    def close(self) -> None:
        self._send(self.sink.done_rows)

    def _send(self, done: int) -> None:
        self.last = time.monotonic()
        sink = self.sink
        tokens = (sink.run_tokens, sink.run_spec_tokens, sink.run_spec_rounds)
        self.conn.send(("progress", done - self.sent, *tokens))
        self.sent = done


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent ends (Linux): parts are committed by renames, so nothing is left
    half-written, and the next run takes this worker's claims over."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it ended before prctl
        os._exit(1)


def _parent_guard(task: WorkerTask) -> None:
    if os.getppid() != task.parent_pid:
        raise JobError(
            f"worker {task.index}: its parent batchrun process is gone; stopping without "
            "committing more"
        )


def work(task: WorkerTask, conn: Connection) -> int:
    """Run the worker; returns its exit status (0, or EXIT_STOPPED after a signal)."""
    job, clock = task.job, RunClock()
    with StopSignals() as stop, published(MetricsPlan.of(job, worker=task.index)) as metrics:
        opened = open_job(job)
        spec = job.output
        out = OutputDir.at(spec.directory, (task.index, task.count), None, spec.claims_dir)
        out.check(opened.fingerprint, overwrite=False)  # records the job's hash for parts
        out.guard = lambda: _parent_guard(task)
        opened = dataclasses.replace(opened, out=out)
        from batchrun.config.preflight import preflight  # needs transformers, as the engine does

        found = preflight(job, opened.prompt, opened.row_tokens)
        engine = build_engine(job, found.tokenizer, None, found.batch)
        clock.engine_ready()
        builder = request_builder(job, opened.prompt, opened.source.schema, engine, True)
        total = opened.source.total_rows
        chunks = list(task.chunks)
        worker = (task.index, task.count)
        puller = ChunkPuller(
            opened.source, out, chunks, task.chunk_rows, out.done_mask(total), worker
        )
        # Claims follow the engine's demand: one chunk read ahead, no more queued than a batch
        # (nor, in a small job, than half a worker's share: a worker that starts late finds
        # rows), and rows reordered for admission within that many only.
        half_share = -(-total // (2 * task.count))
        max_queued = max(1, min(engine.max_batch_size, half_share))
        window = min(job.run.schedule_window, max(max_queued, task.chunk_rows))
        pace = Pace(task.chunk_rows, max_queued, window)
        run = LocalRun(
            opened,
            engine,
            builder,
            clock,
            stop=stop,
            metrics=metrics,
            source=puller,
            pace=pace,
            share=task.share,
        )
        bar = PipeBar(conn, run.sink)
        run.sink.bar = run.sink.error_log.bar = bar
        stop.defer()
        stopped = run.generate_rows()  # the claims are released once its rows are committed
        stats = run.sink.current_stats()
        out.write_json(out.stats_path, stats)
        conn.send(("done", _report(engine.info(), engine.block_size, run, stats)))
        return EXIT_STOPPED if stopped else 0


def _report(
    info: dict[str, Any], block_size: int | None, run: LocalRun, stats: dict[str, Any]
) -> dict[str, Any]:
    """What the parent needs for the job's stats.json."""
    return {
        "info": info,
        "block_size": block_size,
        "run_tokens": run.sink.run_tokens,
        "timing": [stats["wall_seconds"], stats["load_seconds"], stats["generation_seconds"]],
    }


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    conn = Connection(sock.detach())
    task: WorkerTask = conn.recv()
    _die_with_parent(task.parent_pid)
    try:
        status = work(task, conn)
    except JobError as exc:
        conn.send(("error", str(exc) or type(exc).__name__))
        status = 2
    except JobStopped:
        status = EXIT_STOPPED  # stopped in start-up: nothing to commit
    except BrokenPipeError:
        status = 1  # the parent is gone
    sys.exit(status)


if __name__ == "__main__":
    main()
