"""The `batchrun` command: run a job, validate a job file, summarize or report on an output
directory."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

import batchrun
from batchrun.bench.command import bench
from batchrun.errors import EXIT_STOPPED, JobError, JobStopped
from batchrun.io.prompts import (
    CHAT_KWARGS_COLUMN,
    CONSTRAINT_COLUMNS,
    DEFAULT_PROMPT_COLUMNS,
    OVERRIDE_COLUMNS,
    PromptKind,
    template_thinks,
)
from batchrun.job import JobSpec, load_job
from batchrun.pipeline import OpenedJob, open_job, run_job, summary_line
from batchrun.schemas import MAX_LOGPROBS
from batchrun.shard_env import apply_env_shard

if TYPE_CHECKING:
    from batchrun.models.dflash_loader import DraftSpec
    from batchrun.preflight import Preflight


class _Group(click.Group):
    """Reports a JobError, a bad flag or a path the filesystem refuses as one line on stderr and
    exit code 2, without a traceback or a usage block."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except JobError as exc:
            _fail(ctx, str(exc) or type(exc).__name__)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            _fail(ctx, f"{exc.format_message()} (see '{command} --help')")
        except OSError as exc:  # a path the filesystem refuses (too long, a loop, no access)
            where = f": {str(exc.filename)[:200]!r}" if exc.filename is not None else ""
            _fail(ctx, f"{exc.strerror or type(exc).__name__}{where}")


def _verify_width(value: str | None) -> int | str | None:
    if value is None or value in ("auto", "full"):
        return value
    if value.isdigit():
        return int(value)
    raise click.BadParameter(f"expected auto, full or a positive integer, got {value!r}")


def _json_object(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"expected a JSON object, got {value!r}")
    return parsed


def _fail(ctx: click.Context, message: str) -> None:
    click.echo(f"batchrun: error: {' '.join(message.split())}", err=True)
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
    click.option("--max-tokens", type=int, help="Maximum tokens generated per row."),
    click.option("--temperature", type=float, help="Sampling temperature; 0 is greedy."),
    click.option("--top-p", type=float, help="Nucleus sampling mass; 1 keeps every token."),
    click.option("--top-k", type=int, help="Top-k cutoff; 0 = off."),
    click.option(
        "--seed",
        type=int,
        help="Job seed, any integer in [-2^63, 2^64), used modulo 2^64; each row gets its own.",
    ),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--stop-token-ids", type=int, multiple=True, help="Stop token id (repeatable)."),
    click.option(
        "--max-thinking-tokens",
        type=int,
        help="Tokens a think block may take; then its end is forced and the answer follows.",
    ),
    click.option(
        "--json-schema",
        metavar="JSON",
        help="Every completion is JSON matching this JSON Schema (structured output).",
    ),
    click.option("--regex", help="Every completion matches this regular expression."),
    click.option(
        "--choice", multiple=True, help="Every completion is one of these strings (repeatable)."
    ),
    click.option(
        "--max-constraint-bytes",
        type=int,
        help="A constraint longer than this is not compiled: its row is an error row.",
    ),
    click.option(
        "--grammar-compile-timeout",
        type=float,
        help="Seconds a constraint may take to compile; then its row is an error row.",
    ),
    click.option(
        "--ignore-eos/--no-ignore-eos",
        default=None,
        help="Generate past end-of-sequence tokens until max_tokens or a stop.",
    ),
    click.option(
        "--presence-penalty",
        type=float,
        help="Subtracted from the logit of each token the output holds, in [-2, 2].",
    ),
    click.option(
        "--frequency-penalty",
        type=float,
        help="Subtracted per occurrence in the output from a token's logit, in [-2, 2].",
    ),
    click.option(
        "--repetition-penalty",
        type=float,
        help="Divides positive (multiplies negative) logits of tokens in the prompt or output; "
        "1 = off.",
    ),
    click.option(
        "--min-tokens",
        type=int,
        help="Tokens generated before an end-of-sequence token, stop id or stop string may end "
        "a row.",
    ),
    click.option(
        "--min-p",
        type=float,
        help="Drop tokens less probable than min_p x the most probable one; 0 = off.",
    ),
    click.option("--n", type=int, help="Samples per row (n output rows, sample_index 0 .. n-1)."),
    click.option(
        "--logprobs",
        type=int,
        metavar="K",
        help=f"Write each completion token's log-probability, and with K > 0 its K (up to "
        f"{MAX_LOGPROBS}) most probable tokens.",
    ),
    click.option(
        "--prompt-logprobs",
        type=int,
        is_flag=False,
        flag_value=0,
        metavar="[K]",
        help=f"Write each prompt token's log-probability, and with K > 0 its K (up to "
        f"{MAX_LOGPROBS}) most probable tokens (turns prefix caching off); alone: K = 0. Write "
        "it after JOB_FILE.",
    ),
    click.option(
        "--no-prompt-logprobs",
        is_flag=True,
        default=None,
        help="No prompt log-probabilities (turns off a job file's prompt_logprobs).",
    ),
    click.option(
        "--chat-template-kwargs",
        metavar="JSON",
        callback=lambda _ctx, _param, value: _json_object(value),
        help="Arguments to the chat template, a JSON object, e.g. '{\"enable_thinking\": false}'.",
    ),
    click.option(
        "--thinking/--no-thinking",
        default=None,
        help="Turn the chat template's thinking on or off (enable_thinking; Qwen3 thinks by "
        "default).",
    ),
    click.option(
        "--reasoning-parser",
        type=click.Choice(["qwen3", "auto"]),
        help="Split the think block from the answer: columns reasoning, reasoning_tokens.",
    ),
    click.option("--dtype", help="auto, float32, bfloat16 or float16."),
    click.option("--device", help="auto, cpu, cuda or cuda:N."),
    click.option(
        "--attention-backend",
        help="auto (triton on a GPU, torch on a CPU), torch, triton or flashinfer (GPU, eager).",
    ),
    click.option(
        "--kv-cache-dtype",
        help="The target's KV cache: auto (the model dtype) or fp8 (float8_e4m3fn, per-layer "
        "scales: about twice the pages; torch and triton backends).",
    ),
    click.option(
        "--cuda-graphs/--no-cuda-graphs", default=None, help="CUDA graphs for decode/verify steps."
    ),
    click.option(
        "--prefix-caching/--no-prefix-caching",
        default=None,
        help="Reuse the K/V of prompt prefixes that rows share.",
    ),
    click.option(
        "--verify-width",
        callback=lambda _ctx, _param, value: _verify_width(value),
        help="Tokens verified per request and step with a draft: auto (chosen each step from "
        "measured costs and acceptance), full (the block) or 1 .. the draft's block size.",
    ),
    click.option("--max-batch-size", type=int, help="Requests in flight."),
    click.option("--max-batched-tokens", type=int, help="Tokens per forward pass."),
    click.option(
        "--schedule-window",
        type=int,
        help="Input rows read ahead and admitted shared prefixes together, longest first; "
        "0 = input order.",
    ),
    click.option(
        "--gpu-memory-fraction", type=float, help="GPU memory batchrun may use (KV pools last)."
    ),
    click.option(
        "--tp",
        type=int,
        help="Tensor parallel size: processes (one per GPU) the target is split across, "
        "launched with torchrun.",
    ),
    click.option(
        "--shard",
        help='Run shard I of N, as "I/N": about 1/N of the rows, as whole row groups (unset: '
        "from a Slurm array task or a torchrun rank, if any).",
    ),
    click.option(
        "--overwrite/--no-overwrite",
        default=None,
        help="Delete earlier output in the output directory first (default: off; --no-overwrite "
        "turns off a job file's overwrite = true).",
    ),
    click.option(
        "--quiet", is_flag=True, default=None, help="No progress bar (the summary still prints)."
    ),
    click.option("--rows-per-part", type=int, help="Rows per part file."),
    click.option("--part-seconds", type=float, help="Commit a part at least this often."),
]


def _run_options(command: Any) -> Any:
    for option in reversed(_RUN_OPTIONS):
        command = option(command)
    return command


# What an unset job key means, for --help (the other defaults are JobSpec's own).
_UNSET_MEANS = {
    "draft": "none",
    "prompt_column": f"{DEFAULT_PROMPT_COLUMNS[PromptKind.TEXT]}, if the input has it",
    "messages_column": f"{DEFAULT_PROMPT_COLUMNS[PromptKind.MESSAGES]}, if the input has it",
    "token_ids_column": f"{DEFAULT_PROMPT_COLUMNS[PromptKind.TOKEN_IDS]}, if the input has it",
    "id_column": "none; rows are named by row_index",
    "logprobs": "off",
    "prompt_logprobs": "off",
    "chat_template_kwargs": "none",
    "thinking": "the chat template's default",
    "reasoning_parser": "none",
    "max_thinking_tokens": "no limit",
    "json_schema": "none",
    "regex": "none",
    "choice": "none",
    "shard": "from SLURM_ARRAY_TASK_ID/COUNT or RANK/WORLD_SIZE, else every row",
}


def _default_text(field: dataclasses.Field[Any]) -> str:
    if field.default is dataclasses.MISSING:
        return "[required, here or in the job file]"
    default = field.default
    if default is None:
        text = _UNSET_MEANS[field.name]
    elif isinstance(default, bool):
        text = "on" if default else "off"
    elif isinstance(default, tuple):
        text = ", ".join(map(str, default)) or "none"
    else:
        text = str(default)
    return f"[default: {text}]"


def _help_states_job_defaults(command: click.Command) -> click.Command:
    """Append JobSpec's default to each job flag's help. Flags default to None (unset, so a
    job file's value stands), so click's show_default has nothing to show."""
    fields = {field.name: field for field in dataclasses.fields(JobSpec)}
    for param in command.params:
        if isinstance(param, click.Option) and param.name in fields:
            param.help = f"{param.help or ''}  {_default_text(fields[param.name])}".strip()
    return command


def _stops_cleanly(command: Callable[..., None]) -> Callable[..., None]:
    """SIGTERM or SIGINT stops `run` cleanly (batchrun.pipeline.StopSignals): what it finished
    is committed, one line on stderr counts the rows, and it exits EXIT_STOPPED; running the
    same command again resumes."""

    @functools.wraps(command)
    def stopping(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except JobStopped as stop:
            if stop.line is not None:  # None: a tensor-parallel rank whose rank 0 speaks
                click.echo(stop.line, err=True)
            click.get_current_context().exit(EXIT_STOPPED)

    return stopping


def _job(job_file: Path | None, flags: dict[str, Any]) -> JobSpec:
    # An unrepeated multi-value flag arrives as () and means "not set".
    overrides = {
        key: (value or None) if isinstance(value, tuple) else value for key, value in flags.items()
    }
    # --prompt-logprobs takes an optional K, so its off switch is an option of its own.
    if overrides.pop("no_prompt_logprobs"):
        if overrides["prompt_logprobs"] is not None:
            raise click.UsageError("--prompt-logprobs and --no-prompt-logprobs contradict")
        overrides["prompt_logprobs"] = False
    return apply_env_shard(load_job(job_file, overrides), os.environ)


@_help_states_job_defaults
@cli.command()
@click.argument("job_file", required=False, type=click.Path(path_type=Path))
@_run_options
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
    job = _job(job_file, flags)
    if ray_address is not None:
        from batchrun.ray.run import run_job_ray

        if job.tp > 1:
            raise click.UsageError("--tp runs under torchrun, not with --ray")
        stats = run_job_ray(job, ray_address or None, replicas)
    elif replicas is not None:
        raise click.UsageError("--replicas needs --ray")
    elif job.tp > 1:
        from batchrun.launch import torchrun  # torch.distributed, for tensor parallelism only

        if "RANK" not in os.environ:
            sys.exit(torchrun.relaunch(job))
        stats, tp = torchrun.run_rank(job)
        if tp.rank != 0:
            return  # the group's rank 0 speaks for it
    else:
        stats = run_job(job)
    click.echo(summary_line(stats, job.output))


@_help_states_job_defaults
@cli.command()
@click.argument("job_file", required=False, type=click.Path(path_type=Path))
@_run_options
def validate(job_file: Path | None, **flags: Any) -> None:
    """Make every start-up check of `run` (JOB_FILE, flags, input columns, output directory,
    model configs, tokenizer, draft fit, device) without loading weights; runs nothing."""
    from batchrun.preflight import preflight  # needs transformers, as `run` does

    job = _job(job_file, flags)
    opened = open_job(job)
    found = preflight(job, opened.prompt)
    if job.tp > 1:
        from batchrun.launch.torchrun import check

        check(job)
    lines = [f"job file: {job_file}"] if job_file is not None else []
    click.echo("\n".join([*lines, *_input_lines(opened), *_model_lines(job, found), "ok"]))


def _input_lines(opened: OpenedJob) -> list[str]:
    source = opened.source
    settings = (*OVERRIDE_COLUMNS, *CONSTRAINT_COLUMNS, CHAT_KWARGS_COLUMN)
    overrides = [c for c in source.schema.names if c in settings]
    passed = [c for c in source.schema.names if c not in (*overrides, opened.prompt.name)]
    done = int(opened.out.done_mask(source.total_rows).sum()) if opened.out.all_parts() else 0
    damaged = opened.out.damaged_parts()
    rows, shard = opened.rows, opened.job.shard
    return [
        f"input: {len(source.files)} file(s), {source.total_rows} rows",
        *([f"shard: {shard}, {_row_span(rows)}"] if shard is not None else []),
        f"prompt column: {opened.prompt.name} ({opened.prompt.kind.value})",
        f"id column: {opened.id_column or '(none; row_index)'}",
        f"per-row overrides: {', '.join(overrides) or '(none)'}",
        f"pass-through columns: {', '.join(passed) or '(none)'}",
        f"output: {opened.job.output} ({done} of {source.total_rows} rows committed)",
    ] + (
        [f"output: {len(damaged)} damaged part(s): {', '.join(damaged)}; run will redo their rows"]
        if damaged
        else []
    )


def _row_span(rows: range) -> str:
    return f"rows {rows.start} to {rows.stop - 1} ({len(rows)} rows)" if rows else "no rows"


def _model_lines(job: JobSpec, found: Preflight) -> list[str]:
    t, draft = found.target, found.draft
    template = "a chat template" if found.tokenizer.chat_template else "no chat template"
    thinks = template_thinks(found.tokenizer)
    if thinks is not None:
        template += " that thinks by default" if thinks else " that does not think by default"
        if job.thinking is not None:
            template += f"; this job: thinking {'on' if job.thinking else 'off'}"
    context = f"context {t.max_position_embeddings}"
    if t.num_experts:
        context = f"MoE: {t.num_experts} experts, top {t.num_experts_per_tok}, {context}"
    if t.fp8 is not None:
        from batchrun.models.qwen3_sharding import fp8_kept

        context = f"{t.fp8.describe(kept=fp8_kept(t, job.tp))}, {context}"
    if t.yarn is not None:
        yarn = t.yarn
        context += f" (YaRN: {yarn.factor:g} x {yarn.original_max_position_embeddings})"
    return [
        f"target: {job.target} ({t.num_layers} layers, hidden size {t.hidden_size}, "
        f"vocab {t.vocab_size}, {context}; "
        f"tokenizer: {len(found.tokenizer)} tokens, {template})",
        _draft_line(job.draft, draft) if draft is not None else "draft: none",
        f"device: {found.device}, dtype: {str(found.dtype).removeprefix('torch.')}, "
        f"attention backend: {found.attention_backend}, KV cache: {_kv_line(job, found)}",
        f"batch: {job.max_batch_size} requests, {job.max_batched_tokens} tokens per forward",
    ]


def _kv_line(job: JobSpec, found: Preflight) -> str:
    """The target's KV cache dtype; with fp8 its scales, and a draft's (the model dtype)."""
    from batchrun.attention.kv_dtype import kv_dtype

    def name(dtype: object) -> str:
        return str(dtype).removeprefix("torch.")

    text = name(kv_dtype(job.kv_cache_dtype, found.dtype))
    if job.kv_cache_dtype == "fp8":
        draft = f"; the draft's: {name(found.dtype)}" if found.draft is not None else ""
        text += f" (per-layer scales 1.0{draft})"
    return text


def _draft_line(path: object, draft: DraftSpec) -> str:
    attention = draft.attention
    layers = f"{draft.shape.num_layers} layers"
    if attention.num_sliding:
        layers += f" ({attention.num_sliding} sliding over {attention.window} positions)"
    vocab = f", draft vocabulary {draft.head_rows}" if draft.vocab_map else ""
    return (
        f"draft: {path} ({draft.format} format, {layers}, block size {draft.block_size}, "
        f"target layers {list(draft.target_layer_ids)}, mask id {draft.mask_token_id}{vocab})"
    )


@cli.command()
@click.argument("output_dir", type=click.Path(path_type=Path))
def stats(output_dir: Path) -> None:
    """Summarize the part files of OUTPUT_DIR (finished or running; every shard and run)."""
    from batchrun.summary import summarize  # polars is needed for summaries only

    click.echo(summarize(output_dir))


@cli.command()
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


cli.add_command(bench)


def main() -> None:
    cli(prog_name="batchrun")


if __name__ == "__main__":
    main()
