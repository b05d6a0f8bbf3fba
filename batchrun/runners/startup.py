"""The start-up checks of a job that load no weights, in one list: `validate` makes them and
nothing more, `run` makes them before it starts anything (a single run before it claims the
output and loads weights, the --workers parent before any worker starts, the --tp launcher
before torchrun), so a job `validate` accepts is not refused at start-up by `run`, and the two
refuse a job in the same line."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchrun.config.job import JobSpec
from batchrun.errors import JobStopped, not_started_line
from batchrun.runners.metrics import check_plan, node_plans
from batchrun.runners.opened_job import OpenedJob, open_job
from batchrun.runners.stop_signals import stop_line
from batchrun.runners.torchrun_checks import check as check_tp
from batchrun.runners.workers.devices import check_workers, worker_devices

if TYPE_CHECKING:
    from batchrun.config.preflight import Preflight


@dataclass(frozen=True)
class StartChecks:
    """What the checks found: the opened input and output, what the engine will run with, and
    with --workers N each worker's device."""

    opened: OpenedJob
    found: Preflight
    devices: list[str] | None


def check_start(job: JobSpec) -> StartChecks:
    """Every start-up check, in order; raises JobError at the first refusal. Writes nothing."""
    from batchrun.config.preflight import preflight  # needs transformers, as the engine does

    check_workers(job, ray=False)
    devices = worker_devices(job) if job.run.workers > 1 else None
    for plan in node_plans(job):  # every worker's port and textfile, before any starts
        check_plan(plan)
    opened = open_job(job)
    if job.run.tp > 1:  # before preflight: a rank's device is the reason, said as such
        check_tp(job)
    found = preflight(job, opened.prompt, opened.row_tokens)
    return StartChecks(opened, found, devices)


def start_up_stop(stopped: JobStopped, job: JobSpec, opened: OpenedJob | None) -> JobStopped:
    """A signal in start-up (nothing generated yet) as the line `run` prints: what earlier
    runs committed, where the output was opened."""
    line = not_started_line(stopped.signum)
    if opened is not None:
        with contextlib.suppress(Exception):
            committed = opened.committed_rows()
            left = len(opened.rows) - committed
            line = stop_line(stopped.signum, committed, 0, left, job.output.overwrite)
    return JobStopped(stopped.signum, line)
