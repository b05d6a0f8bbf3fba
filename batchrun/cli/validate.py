"""`batchrun validate`: every start-up check of `run`, without loading weights; runs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from batchrun.cli.options import job_flags, job_of
from batchrun.config.job import JobSpec
from batchrun.io.input.overrides import OVERRIDE_COLUMNS
from batchrun.io.input.prompts import CHAT_KWARGS_COLUMN, CONSTRAINT_COLUMNS, template_thinks
from batchrun.layers.rotary import Yarn
from batchrun.runners.opened_job import OpenedJob
from batchrun.runners.startup import check_start

if TYPE_CHECKING:
    from batchrun.config.preflight import Preflight


@click.command()
@click.argument("job_file", required=False, type=click.Path(path_type=Path))
@job_flags
def validate(job_file: Path | None, **flags: Any) -> None:
    """Make every start-up check of `run` (JOB_FILE, flags, input columns, output directory,
    model configs, tokenizer, draft fit, device) without loading weights; runs nothing."""
    job = job_of(job_file, flags)
    checked = check_start(job)  # the checks `run` makes before it starts anything
    opened, found = checked.opened, checked.found
    lines = [f"job file: {job_file}"] if job_file is not None else []
    click.echo("\n".join([*lines, *_input_lines(opened), *_model_lines(job, found), "ok"]))


def _input_lines(opened: OpenedJob) -> list[str]:
    source = opened.source
    settings = (*OVERRIDE_COLUMNS, *CONSTRAINT_COLUMNS, CHAT_KWARGS_COLUMN)
    overrides = [c for c in source.schema.names if c in settings]
    passed = [c for c in source.schema.names if c not in (*overrides, opened.prompt.name)]
    done = int(opened.out.done_mask(source.total_rows).sum()) if opened.out.all_parts() else 0
    damaged = opened.out.damaged_parts()
    rows, shard = opened.rows, opened.job.run.shard
    return [
        f"input: {len(source.files)} file(s), {source.total_rows} rows",
        *([f"shard: {shard}, {_row_span(rows)}"] if shard is not None else []),
        f"prompt column: {opened.prompt.name} ({opened.prompt.kind.value})",
        f"id column: {opened.id_column or '(none; row_index)'}",
        f"per-row overrides: {', '.join(overrides) or '(none)'}",
        f"pass-through columns: {', '.join(passed) or '(none)'}",
        f"output: {opened.job.output.directory} ({done} of {source.total_rows} rows committed)",
    ] + (
        [f"output: {len(damaged)} damaged part(s): {', '.join(damaged)}; run will redo their rows"]
        if damaged
        else []
    )


def _row_span(rows: range) -> str:
    return f"rows {rows.start} to {rows.stop - 1} ({len(rows)} rows)" if rows else "no rows"


def _model_lines(job: JobSpec, found: Preflight) -> list[str]:
    t, draft, engine = found.target, found.checked, job.engine
    template = "a chat template" if found.tokenizer.chat_template else "no chat template"
    thinks = template_thinks(found.tokenizer)
    if thinks is not None:
        template += " that thinks by default" if thinks else " that does not think by default"
        if job.input.thinking is not None:
            template += f"; this job: thinking {'on' if job.input.thinking else 'off'}"
    context = f"context {t.max_position_embeddings}"
    if t.num_experts:
        context = f"MoE: {t.num_experts} experts, top {t.num_experts_per_tok}, {context}"
    if t.fp8 is not None:
        from batchrun.models.qwen3_sharding import fp8_kept

        context = f"{t.fp8.describe(kept=fp8_kept(t, job.run.tp))}, {context}"
    if isinstance(t.rope_scaling, Yarn):
        yarn = t.rope_scaling
        context += f" (YaRN: {yarn.factor:g} x {yarn.original_max_position_embeddings})"
    elif t.rope_scaling is not None:
        context += f" (llama3 RoPE: factor {t.rope_scaling.factor:g})"
    return [
        f"target: {job.engine.target} ({found.family}: {t.num_layers} layers, "
        f"hidden size {t.hidden_size}, "
        f"vocab {t.vocab_size}, {context}; "
        f"tokenizer: {len(found.tokenizer)} tokens, {template})",
        f"draft: {job.engine.draft} ({draft.describe()})" if draft is not None else "draft: none",
        f"device: {found.device}, dtype: {str(found.dtype).removeprefix('torch.')}, "
        f"attention backend: {found.attention_backend}, KV cache: {_kv_line(job, found)}",
        f"batch: {found.batch.size} requests ({found.batch.why}), "
        f"{engine.max_batched_tokens} tokens per forward",
    ] + ([f"target: not run: {', '.join(found.skipped)}"] if found.skipped else [])


def _kv_line(job: JobSpec, found: Preflight) -> str:
    """The target's KV cache dtype; with fp8 its scales, and a draft's (the model dtype)."""
    from batchrun.attention.kv_dtype import kv_dtype

    def name(dtype: object) -> str:
        return str(dtype).removeprefix("torch.")

    text = name(kv_dtype(job.engine.kv_cache_dtype, found.dtype))
    if job.engine.kv_cache_dtype == "fp8":
        draft = f"; the draft's: {name(found.dtype)}" if found.checked is not None else ""
        text += f" (per-layer scales 1.0{draft})"
    return text
