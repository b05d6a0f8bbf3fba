"""`batchrun export`: an output directory in another format (OpenAI Batch output lines)."""

from __future__ import annotations

from pathlib import Path

import click

FORMATS = ("openai-batch",)


@click.command()
@click.argument("output_dir")  # a local path or an s3:// or gs:// URI: not a click.Path
@click.option(
    "--format",
    "format_name",
    type=click.Choice(FORMATS),
    default=FORMATS[0],
    show_default=True,
    help="openai-batch: one OpenAI Batch output line per input row (request).",
)
@click.option(
    "--output",
    "destination",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="File to write, e.g. results.jsonl.",
)
def export(output_dir: str, format_name: str, destination: Path) -> None:
    """Write the rows of OUTPUT_DIR (finished or running; local or s3://...) in another format."""
    from batchrun.io.output.openai_results import write_results

    written = write_results(output_dir, destination)
    running = "" if written.complete else " (the job has not finished: rows to come are left out)"
    click.echo(
        f"batchrun: {written.results} results ({written.errors} errors) -> {destination}{running}"
    )
