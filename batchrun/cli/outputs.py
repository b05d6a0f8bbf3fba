"""`batchrun stats` and `batchrun report`: read an output directory."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("output_dir")  # a local path or an s3:// or gs:// URI: not a click.Path
def stats(output_dir: str) -> None:
    """Summarize the part files of OUTPUT_DIR (finished or running; every shard and run; local
    or s3://...)."""
    from batchrun.reporting.summary import summarize  # polars is needed for summaries only

    click.echo(summarize(output_dir))


@click.command()
@click.argument("output_dir")
@click.option(
    "--out",
    "html_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="HTML file to write.  [default: OUTPUT_DIR/report.html]",
)
def report(output_dir: str, html_file: Path | None) -> None:
    """Write one self-contained HTML page of plots over OUTPUT_DIR (needs batchrun[report])."""
    from batchrun.reporting.report import write_report

    click.echo(f"batchrun: report -> {write_report(output_dir, html_file)}")
