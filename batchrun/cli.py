"""The `batchrun` command: run a job, validate a job file, summarize an output directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

import batchrun
from batchrun.errors import JobError
from batchrun.io.prompts import OVERRIDE_COLUMNS
from batchrun.job import load_job
from batchrun.pipeline import open_job, run_job


class _Group(click.Group):
    """Reports a JobError as one line on stderr and exit code 2, without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except JobError as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            click.echo(f"batchrun: error: {message}", err=True)
            ctx.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(batchrun.__version__, prog_name="batchrun")
def cli() -> None:
    """Offline batch inference over Parquet."""


# Flags of `run`: each sets the job key of the same name (dashes become underscores).
_RUN_OPTIONS = [
    click.option("--input", "input", help="Parquet file, directory of Parquet files, or glob."),
    click.option("--output", help="Output directory."),
    click.option("--target", help="Target model directory."),
    click.option("--draft", help='DFlash draft model directory, or "none".'),
    click.option("--prompt-column", help="Text prompt column."),
    click.option("--messages-column", help="Chat messages column."),
    click.option("--token-ids-column", help="Prompt token ids column."),
    click.option("--id-column", help="Column naming rows in logs."),
    click.option("--max-tokens", type=int),
    click.option("--temperature", type=float),
    click.option("--top-p", type=float),
    click.option("--top-k", type=int, help="0 = off."),
    click.option("--seed", type=int),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--stop-token-ids", type=int, multiple=True, help="Stop token id (repeatable)."),
    click.option("--dtype", help="auto, float32, bfloat16 or float16."),
    click.option("--device", help="auto, cpu or cuda."),
    click.option("--attention-backend", help="auto, torch, triton or flashinfer."),
    click.option("--cuda-graphs/--no-cuda-graphs", default=None),
    click.option("--max-batch-size", type=int, help="Requests in flight."),
    click.option("--max-batched-tokens", type=int, help="Tokens per forward pass."),
    click.option("--shard", help='Run the rows with row_index % N == I, as "I/N".'),
    click.option(
        "--overwrite/--no-overwrite",
        default=None,
        help="Delete earlier output in the output directory first (default: off; --no-overwrite "
        "turns off a job file's overwrite = true).",
    ),
    click.option("--quiet", is_flag=True, default=None, help="No progress bar."),
    click.option("--rows-per-part", type=int, help="Rows per part file."),
    click.option("--part-seconds", type=float, help="Commit a part at least this often."),
]


def _run_options(command: Any) -> Any:
    for option in reversed(_RUN_OPTIONS):
        command = option(command)
    return command


@cli.command()
@click.argument("job_file", required=False, type=click.Path(path_type=Path))
@_run_options
def run(job_file: Path | None, **flags: Any) -> None:
    """Run a job: JOB_FILE (TOML), overridden by flags."""
    # An unrepeated multi-value flag arrives as () and means "not set".
    overrides = {
        key: (value or None) if isinstance(value, tuple) else value for key, value in flags.items()
    }
    job = load_job(job_file, overrides)
    stats = run_job(job)
    if not job.quiet:
        click.echo(
            f"batchrun: {stats['rows']} rows ({stats['ok_rows']} ok, "
            f"{stats['error_rows']} errors), {stats['completion_tokens']} completion tokens "
            f"-> {job.output}",
            err=True,
        )


@cli.command()
@click.argument("job_file", type=click.Path(path_type=Path))
def validate(job_file: Path) -> None:
    """Check JOB_FILE and its input's columns; runs nothing."""
    job = load_job(job_file)
    opened = open_job(job)
    source = opened.source
    overrides = [c for c in source.schema.names if c in OVERRIDE_COLUMNS]
    done = int(opened.out.done_mask(source.total_rows).sum()) if opened.out.all_parts() else 0
    damaged = opened.out.damaged_parts()
    lines = [
        f"job file: {job_file}",
        f"input: {len(source.files)} file(s), {source.total_rows} rows",
        f"prompt column: {opened.prompt.name} ({opened.prompt.kind.value})",
        f"id column: {opened.id_column or '(none; row_index)'}",
        f"per-row overrides: {', '.join(overrides) or '(none)'}",
        f"pass-through columns: {', '.join(source.schema.names)}",
        f"target: {job.target}",
        f"draft: {job.draft or 'none'}",
        f"output: {job.output} ({done} of {source.total_rows} rows committed)",
    ]
    if damaged:
        lines.append(
            f"output: {len(damaged)} damaged part(s): {', '.join(damaged)}; "
            "run will redo their rows"
        )
    lines.append("ok")
    click.echo("\n".join(lines))


@cli.command()
@click.argument("output_dir", type=click.Path(path_type=Path))
def stats(output_dir: Path) -> None:
    """Summarize the part files of OUTPUT_DIR (finished or running)."""
    from batchrun.summary import summarize  # polars is needed for summaries only

    click.echo(summarize(output_dir))


@cli.command()
@click.option("--target", required=True, type=click.Path(path_type=Path), help="Target model.")
@click.option("--draft", type=click.Path(path_type=Path), help="DFlash draft (also run).")
@click.option("--num-prompts", default=64, show_default=True)
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--max-tokens", default=128, show_default=True)
@click.option("--max-batch-size", default=64, show_default=True)
@click.option("--max-batched-tokens", default=4096, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--attention-backend", default="auto", show_default=True)
@click.option("--hf-baseline/--no-hf-baseline", default=True, help="Also time generate().")
@click.option("--out", type=click.Path(path_type=Path), help="Write the result JSON here.")
def bench(out: Path | None, **opts: Any) -> None:
    """Time the engine on synthetic prompts against baselines measured in the same run."""
    import json

    from batchrun.bench import bench as run_bench
    from batchrun.bench import write_result
    from batchrun.engine.config import EngineConfig

    config = EngineConfig(
        target=opts["target"],
        draft=opts["draft"],
        dtype=opts["dtype"],
        device=opts["device"],
        attention_backend=opts["attention_backend"],
        max_batch_size=opts["max_batch_size"],
        max_batched_tokens=opts["max_batched_tokens"],
    )
    result = run_bench(
        config,
        num_prompts=opts["num_prompts"],
        prompt_len=opts["prompt_len"],
        max_tokens=opts["max_tokens"],
        hf_baseline=opts["hf_baseline"],
    )
    if out is not None:
        write_result(result, out)
    click.echo(json.dumps(result["ratios"], indent=2))


def main() -> None:
    cli(prog_name="batchrun")


if __name__ == "__main__":
    main()
