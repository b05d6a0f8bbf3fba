"""`batchrun run`: run a job locally, with worker processes on this node (--workers), under
torchrun (--tp) or on a Ray cluster (--ray)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from batchrun.cli.options import job_flags, job_of
from batchrun.errors import EXIT_STOPPED, JobStopped
from batchrun.runners.local import run_job, summary_line
from batchrun.runners.workers.devices import check_workers
from batchrun.runners.workers.run import run_workers


def _stops_cleanly(command: Callable[..., None]) -> Callable[..., None]:
    """SIGTERM or SIGINT stops `run` cleanly (batchrun.runners.stop_signals.StopSignals): what
    it finished is committed, one line on stderr counts the rows, and it exits EXIT_STOPPED;
    running the same command again resumes."""

    @functools.wraps(command)
    def stopping(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except JobStopped as stop:
            if stop.line is not None:  # None: a tensor-parallel rank whose rank 0 speaks
                click.echo(stop.line, err=True)
            click.get_current_context().exit(EXIT_STOPPED)

    return stopping


@click.command()
@click.argument("job_file", required=False, type=click.Path(path_type=Path))
@job_flags
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ADDRESS]",
    help="Run on a Ray cluster (pip install 'batchrun[ray]'): the one at ADDRESS, else the "
    "one RAY_ADDRESS or this machine runs, else a new local one. Write it after JOB_FILE.",
)
@click.option(
    "--replicas",
    type=int,
    help="With --ray: engine actors [default: one per GPU of the cluster, 1 without GPUs].",
)
@_stops_cleanly
def run(job_file: Path | None, ray_address: str | None, replicas: int | None, **flags: Any) -> None:
    """Run a job: JOB_FILE (TOML), overridden by flags. Prints a summary line when done."""
    job = job_of(job_file, flags)
    check_workers(job, ray=ray_address is not None)
    if job.run.workers > 1:
        if replicas is not None:
            raise click.UsageError("--replicas needs --ray")
        stats = run_workers(job)
    elif ray_address is not None:
        from batchrun.runners.ray.run import run_job_ray

        if job.run.tp > 1:
            raise click.UsageError("--tp runs under torchrun, not with --ray")
        stats = run_job_ray(job, ray_address or None, replicas)
    elif replicas is not None:
        raise click.UsageError("--replicas needs --ray")
    elif job.run.tp > 1:
        from batchrun.runners import torchrun  # torch.distributed, for tensor parallelism only

        if "RANK" not in os.environ:
            sys.exit(torchrun.relaunch(job))
        stats, tp = torchrun.run_rank(job)
        if tp.rank != 0:
            return  # the group's rank 0 speaks for it
    else:
        stats = run_job(job)
    click.echo(summary_line(stats, job.output.directory))
