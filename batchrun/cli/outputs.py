"""`batchrun stats` and `batchrun report`: read an output directory."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("output_dir", type=click.Path(path_type=Path))
def stats(output_dir: Path) -> None:
    """Summarize the part files of OUTPUT_DIR (finished or running; every shard and run)."""
    from batchrun.summary import summarize  # polars is needed for summaries only

    click.echo(summarize(output_dir))


@click.command()
@click.argument("output_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "html_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="HTML file to write.  [default: OUTPUT_DIR/report.html]",
)
def report(output_dir: Path, html_file: Path | None) -> None:
    """Write one self-contained HTML page of plots over OUTPUT_DIR (needs batchrun[report])."""
    from batchrun.report import write_report

    click.echo(f"batchrun: report -> {write_report(output_dir, html_file)}")
