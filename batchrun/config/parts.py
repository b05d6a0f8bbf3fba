"""The job's parts other than sampling (batchrun/sampling/params.py declares that one), each
setting declared once: its type, range, default, help, where it may be set and whether the
fingerprint records it. The engine's own options are declared in its stack
(batchrun/engine/options.py), and the engine part takes them from there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.engine.options import EngineOptions
from batchrun.errors import JobError
from batchrun.io.input.prompts import DEFAULT_PROMPT_COLUMNS, PromptKind
from batchrun.io.output.reasoning import REASONING_PARSERS
from batchrun.sampling.option import Kind, Record, option

_PATH_NOTE = "Relative paths in a job file resolve against the job file's directory."
_NAME = {"minLength": 1}  # a column name or path: not empty

# Most probable tokens listed per position (logprobs = k, prompt_logprobs = K), vLLM's default.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class InputPart:
    """Where the rows come from and how a row becomes a prompt. At most one of the three prompt
    columns is set (job rules); chat_template_kwargs never names batchrun's own arguments."""

    path: str = option(
        key="input",
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Parquet file, directory of Parquet files, or glob; files are read sorted by path. "
        "Local, or in object storage (s3://bucket/prefix/*.parquet, gs://...). "
        "An OpenAI Batch request file (*.jsonl) reads as rows too. " + _PATH_NOTE,
        help="Parquet file, directory of Parquet files, or glob; or an OpenAI Batch .jsonl.",
    )
    prompt_column: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Text prompt column (default: `prompt` if it exists).",
        help="Text prompt column.",
        unset=f"{DEFAULT_PROMPT_COLUMNS[PromptKind.TEXT]}, if the input has it",
    )
    messages_column: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Chat column, list<struct<role, content>>, rendered with the target's chat template "
        "(default: `messages` if it exists).",
        help="Chat messages column.",
        unset=f"{DEFAULT_PROMPT_COLUMNS[PromptKind.MESSAGES]}, if the input has it",
    )
    token_ids_column: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Column of prompt token ids, list<int> (default: `prompt_token_ids` if it exists).",
        help="Prompt token ids column.",
        unset=f"{DEFAULT_PROMPT_COLUMNS[PromptKind.TOKEN_IDS]}, if the input has it",
    )
    id_column: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Column that names rows in logs (row_index serves when unset; need not be unique).",
        help="Column naming rows in logs.",
        unset="none; rows are named by row_index",
    )
    chat_template_kwargs: dict[str, Any] | None = option(
        None,
        kind=Kind.OBJECT,
        doc="Arguments to the chat template of messages rows, e.g. "
        "{enable_thinking = false} for Qwen3; a row's chat_template_kwargs column (a JSON "
        "object or a struct) adds to them.",
        help="Arguments to the chat template, a JSON object, e.g. '{\"enable_thinking\": false}'.",
        metavar="JSON",
        unset="none",
    )
    thinking: bool | None = option(
        None,
        kind=Kind.BOOL,
        doc="Shorthand for chat_template_kwargs.enable_thinking (Qwen3's switch); "
        "unset: the template's default.",
        help="Turn the chat template's thinking on or off (enable_thinking; Qwen3 thinks by "
        "default).",
        unset="the chat template's default",
    )

    def chat_kwargs(self) -> dict[str, Any]:
        """The chat template's arguments: chat_template_kwargs, with thinking as enable_thinking."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking
        return kwargs


@dataclass(frozen=True)
class StructuredPart:
    """The structured output every row must match, as the job file writes it: at most one of
    json_schema, regex and choice (job rules); a row's own columns replace it."""

    json_schema: str | dict[str, Any] | None = option(
        None,
        kind=Kind.SCHEMA,
        schema={"type": ["string", "object"]},
        doc="Every completion is JSON matching this JSON Schema (JSON text, or "
        'a table), written compactly (", " and ": " between items); a row\'s '
        "json_schema, regex or choice column replaces it. One of json_schema, regex and "
        "choice. Keywords the grammar engine does not enforce are refused (the README "
        "lists those it does).",
        help="Every completion is JSON matching this JSON Schema (structured output).",
        metavar="JSON",
        unset="none",
    )
    regex: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Every completion matches this regular expression (whole); a row's "
        "json_schema, regex or choice column replaces it.",
        help="Every completion matches this regular expression.",
        unset="none",
    )
    choice: tuple[str, ...] | None = option(
        None,
        kind=Kind.STRINGS,
        schema={"minItems": 1},
        doc="Every completion is one of these strings; a row's json_schema, "
        "regex or choice column replaces it.",
        help="Every completion is one of these strings (repeatable).",
        unset="none",
    )


@dataclass(frozen=True)
class OutputPart:
    """Where and how the output is written, and which optional columns it has."""

    directory: str = option(
        key="output",
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Output directory for part files, progress and stats, or an object-store prefix "
        f"(s3://bucket/prefix, gs://bucket/prefix; gs:// needs claims_dir). {_PATH_NOTE}",
        help="Output directory, or s3://bucket/prefix.",
    )
    claims_dir: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Where the claims of an object-store output live instead of its bucket (a local "
        "directory, or one shared by every node that runs the job). An s3:// output keeps them "
        "in OUTPUT/_claims in the bucket without it (S3's conditional writes, through boto3); a "
        "gs:// output needs it. Every run of the job must name the same one. A local output "
        f"keeps its claims in OUTPUT/_claims and ignores this. {_PATH_NOTE}",
        help="Claims directory of an s3:// or gs:// output (local or shared).",
        metavar="DIR",
        unset="none: in the s3:// output's bucket; a gs:// output needs it",
    )
    logprobs: int | None = option(
        None,
        kind=Kind.INT,
        low=0,
        high=MAX_LOGPROBS,
        doc="Adds completion_logprobs and completion_logprob_sum (each completion "
        "token's log-probability under the distribution it was sampled from: after "
        "logit_bias, min_tokens, the penalties, temperature, min_p, top_k and top_p) "
        "and, when above 0, top_logprobs: that many most probable tokens per position. "
        "Unset: off.",
        help=f"Write each completion token's log-probability, and with K > 0 its K (up to "
        f"{MAX_LOGPROBS}) most probable tokens.",
        metavar="K",
        unset="off",
    )
    # None: off; K: each prompt token's log-probability and its top K (true is 0, false None)
    prompt_logprobs: int | None = option(
        None,
        kind=Kind.SCHEMA,
        schema={
            "anyOf": [
                {"type": "boolean"},
                {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            ]
        },
        doc="true or K (true is 0): adds prompt_logprobs, each prompt token's "
        "log-probability under the target given the tokens before it, and when K is above "
        "0, prompt_top_logprobs: that many most probable tokens per position. Prompts are "
        "then computed in full (no prefix caching). false or unset: off.",
        help=f"Write each prompt token's log-probability, and with K > 0 its K (up to "
        f"{MAX_LOGPROBS}) most probable tokens (turns prefix caching off); alone: K = 0. Write "
        "it after JOB_FILE.",
        metavar="[K]",
        unset="off",
    )
    reasoning_parser: str | None = option(  # qwen3 | auto: the think block apart from the answer
        None,
        kind=Kind.TEXT,
        schema={"enum": list(REASONING_PARSERS)},
        doc="Split each completion's think block from its answer: columns "
        "reasoning and reasoning_tokens, completion the answer only. auto: qwen3 where the "
        "tokenizer has <think> and </think> tokens.",
        help="Split the think block from the answer: columns reasoning, reasoning_tokens.",
        flag_choices=True,
        unset="none",
        record=Record.WHEN_SET,  # its columns; unset: none
    )
    overwrite: bool = option(
        False,
        kind=Kind.BOOL,
        doc="Delete this job's earlier output in the output directory first.",
        help="Delete earlier output in the output directory first (default: off; --no-overwrite "
        "turns off a job file's overwrite = true).",
    )
    rows_per_part: int = option(
        1000, kind=Kind.INT, low=1, doc="Rows per output part file.", help="Rows per part file."
    )
    part_seconds: float = option(
        60.0,
        kind=Kind.FLOAT,
        low=0,
        low_open=True,
        doc="Commit a part after this many seconds even if it is not full, "
        "so a killed job loses little work.",
        help="Commit a part at least this often.",
    )


@dataclass(frozen=True, kw_only=True)
class _Models:
    """The models the engine runs: the first keys of the engine part."""

    # The fingerprint records their files (names, sizes, mtimes; config/fingerprint.py).
    target: str = option(
        kind=Kind.TEXT,
        schema=_NAME,
        doc=f"Target model directory (Hugging Face layout). {_PATH_NOTE}",
        help="Target model directory.",
        record=Record.ALWAYS,
    )
    draft: str | None = option(  # None: no draft ("none" in a job file or flag)
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Draft model directory (a DFlash draft; its method: speculative_method), or "
        '"none" for plain decoding (the default). ' + _PATH_NOTE,
        help='Draft model directory (a DFlash draft), or "none".',
        unset="none",
        record=Record.ALWAYS,
    )


@dataclass(frozen=True, kw_only=True)
class EnginePart(EngineOptions, _Models):
    """The models, then how the engine runs them (engine/options.py declares those): engine
    settings, not what a row asks. Keys in field order: the models' first."""


@dataclass(frozen=True)
class RunPart:
    """How this process takes part in the job: its rows, its processes, its progress."""

    schedule_window: int = option(
        4096,
        kind=Kind.INT,
        low=0,
        doc="Input rows read ahead and admitted sorted: rows sharing a prompt prefix side by "
        "side, the longest first; 0 admits rows in input order. Outputs do not change.",
        help="Input rows read ahead and admitted shared prefixes together, longest first; "
        "0 = input order.",
    )
    tp: int = option(  # tensor-parallel processes
        1,
        kind=Kind.INT,
        low=1,
        doc="Tensor parallel size: the target's heads, MLP rows and vocabulary split across this "
        "many processes, one per GPU (gloo processes on a CPU), run under torchrun "
        "(re-executed under it when not launched so). Under a torchrun of WORLD_SIZE "
        "processes, each tp consecutive ranks form one group, a data-parallel shard of "
        "WORLD_SIZE / tp. Outputs do not change.",
        help="Tensor parallel size: processes (one per GPU) the target is split across, "
        "launched with torchrun.",
    )
    shard: str | None = option(  # "I/N"
        None,
        kind=Kind.TEXT,
        schema={"pattern": "^[0-9]+/[0-9]+$"},
        doc='Process shard I of N, given as "I/N": whole row groups, one '
        "contiguous run of them with about 1/N of the rows; shards share one output "
        "directory. Unset: from SLURM_ARRAY_TASK_ID/COUNT or RANK/WORLD_SIZE (each "
        "tensor-parallel group one shard) if set, else every row.",
        help='Run shard I of N, as "I/N": about 1/N of the rows, as whole row groups (unset: '
        "from a Slurm array task or a torchrun rank, if any).",
        unset="from SLURM_ARRAY_TASK_ID/COUNT or RANK/WORLD_SIZE, else every row",
    )
    workers: int = option(
        1,
        kind=Kind.INT,
        low=1,
        doc="Worker processes on this node, one per device of `devices` (or all of them on "
        "the CPU with device cpu): they share the output and each takes the next unclaimed "
        "row group as it frees up, so a slow worker takes less; a killed worker's row groups "
        "are taken over once its claim is stale. One progress bar and one stats.json for the "
        "job. Not with tp > 1, ray or shard.",
        help="Worker processes on this node (one per GPU, or on the CPU with --device cpu), "
        "pulling row groups as they free up.",
        metavar="N",
    )
    devices: str | None = option(  # "0,1,3": CUDA device indices, one per worker
        None,
        kind=Kind.TEXT,
        schema={"pattern": "^[0-9]+(,[0-9]+)*$"},
        doc='With workers: the CUDA devices the workers run on, as indices ("0,1,3"), one '
        "per worker in order; at least as many as workers.",
        help='With --workers: the CUDA devices to use, as "0,1,..." (unset: every visible GPU).',
        metavar="LIST",
        unset="every visible GPU",
    )
    quiet: bool = option(
        False,
        kind=Kind.BOOL,
        doc="No progress bar on stderr.",
        help="No progress bar (the summary still prints).",
        negatable=False,
    )
    metrics_port: int | None = option(
        None,
        kind=Kind.INT,
        low=1,
        high=65535,
        doc="While the job runs, serve Prometheus metrics (rows, tokens, tokens/s, steps, "
        "acceptance, KV pages) at http://METRICS_HOST:PORT/metrics; shard I of N (or worker "
        "I of workers) serves on PORT + I. A port in use, any process's, stops the job before "
        "it starts (validate refuses it too). Not with --ray.",
        help="Serve Prometheus metrics at http://METRICS_HOST:PORT/metrics while the job runs "
        "(shard or worker I: PORT + I).",
        metavar="PORT",
        unset="off",
    )
    metrics_host: str = option(
        "127.0.0.1",
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Address the metrics port binds: loopback by default; 0.0.0.0 (or ::) lets a "
        "Prometheus on another node scrape it.",
        help="Address the metrics port binds (0.0.0.0: reachable from other nodes).",
        metavar="ADDR",
    )
    metrics_file: str | None = option(
        None,
        kind=Kind.TEXT,
        schema=_NAME,
        doc="Write the same metrics to this node-exporter textfile (replaced atomically every "
        "few seconds and at the end); shard I of N (or worker I of workers) writes NAME-I.prom "
        "beside it. A path that cannot be written, any process's, stops the job before it "
        f"starts (validate refuses it too). Not with --ray. {_PATH_NOTE}",
        help="Write the metrics as a node-exporter textfile, refreshed while the job runs.",
        metavar="PATH",
        unset="off",
    )

    @property
    def shard_spec(self) -> tuple[int, int] | None:
        """(I, N) of --shard I/N, or None."""
        return parse_shard(self.shard) if self.shard is not None else None


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) of "I/N"; the schema has already checked the form."""
    index, count = (int(part) for part in text.split("/"))
    if count < 1 or index >= count:
        raise JobError(f"job key 'shard': {text!r} needs 0 <= I < N")
    return index, count
