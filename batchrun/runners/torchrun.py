"""`batchrun run --tp N`: a job on N tensor-parallel processes of this host.

Outside torchrun the job is checked, then re-executed under torch.distributed.run (standalone
rendezvous on a free port) as N processes of `python -m batchrun.runners.torchrun JOB`, each
handed the resolved job as JSON. Inside torchrun (those, or `torchrun ... -m batchrun.cli run
--tp N`) each process joins its tensor-parallel group and runs the job in lockstep with the
group. Rank 0 prints the summary line; a JobError is one line on stderr and exit status 2, and a
stop by a signal one line and EXIT_STOPPED, as from `batchrun run`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from batchrun.config.job import JobSpec
from batchrun.errors import EXIT_STOPPED, JobError, JobStopped
from batchrun.models.loader import qwen3_shape, read_config
from batchrun.models.qwen3_sharding import local_shape
from batchrun.parallel.group import TensorParallel, init_from_env
from batchrun.runners.local import run_job, summary_line
from batchrun.runners.startup import check_start
from batchrun.runners.stop_signals import STOP_SIGNALS
from batchrun.runners.torchrun_checks import device_type


def relaunch(job: JobSpec) -> int:
    """Run the job as job.run.tp torchrun processes; their exit status (EXIT_STOPPED when a signal
    stopped them)."""
    check_start(job)  # validate's checks, said once here rather than by every rank
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    worker = ["-m", "batchrun.runners.torchrun", json.dumps(job.to_dict())]
    command = [*torchrun, f"--nproc-per-node={job.run.tp}", *worker]
    environ = dict(os.environ)
    environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.run.tp)))
    # In a session of its own, so that a terminal's Ctrl-C (or a signal to this process group)
    # reaches torchrun once, from here: torchrun passes it on to the ranks (each in a session
    # of its own), which stop together and commit (batchrun.runners.stop_signals.StopSignals).
    process = subprocess.Popen(command, env=environ, start_new_session=True)
    with _forward_stop_signals(process) as forwarded:
        status = process.wait()
    return EXIT_STOPPED if forwarded and status != 0 else status


@contextlib.contextmanager
def _forward_stop_signals(process: subprocess.Popen[bytes]) -> Iterator[list[int]]:
    """While within: the first SIGTERM or SIGINT goes on to `process`, and is listed; a second
    ends this process at once (the default action; the ranks still stop as the first asked)."""
    forwarded: list[int] = []

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        for installed in previous:
            signal.signal(installed, signal.SIG_DFL)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for stop in STOP_SIGNALS:
            if signal.getsignal(stop) is not signal.SIG_IGN:
                previous[stop] = signal.signal(stop, forward)
    try:
        yield forwarded
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def run_rank(job: JobSpec) -> tuple[dict[str, Any], TensorParallel]:
    """This torchrun process's part of the job: its group's, on GPU LOCAL_RANK or the CPU."""
    tp = init_from_env(os.environ, device_type(job), job.run.tp)
    shape = qwen3_shape(read_config(Path(job.engine.target), "target model"))
    local_shape(shape, tp)  # one line if the target does not split over the group
    try:
        stats = run_job(job, tp=tp)
    except JobStopped:
        _leave(tp)  # a signal stops the ranks at one step (StopSignals): they leave together
        raise
    _leave(tp)
    return stats, tp


def _leave(tp: TensorParallel) -> None:
    tp.barrier()  # no rank tears its connections down while another still uses them (gloo aborts)
    dist.destroy_process_group()  # after a failure, torchrun ends the other ranks instead


def main(argv: list[str]) -> int:
    try:
        job = JobSpec.from_keys(json.loads(argv[1]))
        stats, tp = run_rank(job)
    except JobError as exc:
        print(f"batchrun: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except JobStopped as stop:  # by SIGTERM or SIGINT, as `batchrun run` stops
        if stop.line is not None:  # rank 0's
            print(stop.line, file=sys.stderr)
        return EXIT_STOPPED
    if tp.rank == 0:
        print(summary_line(stats, job.output.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
