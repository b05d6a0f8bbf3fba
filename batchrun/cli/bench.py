"""`batchrun bench` where the benchmark harness is installed (a source checkout); elsewhere (the
wheel leaves batchrun.bench out) a command that says in one line how to get it."""

from __future__ import annotations

import importlib.util

import click

from batchrun.errors import JobError

HARNESS_MISSING = (
    "`batchrun bench` needs the benchmark harness, which the wheel leaves out: install batchrun "
    "from a source checkout (pip install -e <checkout>)"
)


def bench_command() -> click.Command:
    if importlib.util.find_spec("batchrun.bench") is None:
        return _harness_missing
    from batchrun.bench.command import bench

    return bench


@click.command(
    "bench",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
def _harness_missing() -> None:
    """Time the engine (needs the benchmark harness of a source checkout)."""
    raise JobError(HARNESS_MISSING)
