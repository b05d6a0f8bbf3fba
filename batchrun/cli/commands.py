"""The `batchrun` command group: run a job, validate a job file, summarize or report on an
output directory, benchmark. Job flags are derived from the options' declarations (options.py)."""

from __future__ import annotations

import click

import batchrun
from batchrun.cli.bench import bench_command
from batchrun.cli.export import export
from batchrun.cli.group import Group
from batchrun.cli.outputs import report, stats
from batchrun.cli.run import run
from batchrun.cli.validate import validate


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(batchrun.__version__, prog_name="batchrun")
def cli() -> None:
    """Offline batch inference over Parquet."""


for command in (run, validate, stats, report, export, bench_command()):
    cli.add_command(command)
