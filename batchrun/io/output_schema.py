"""The output Arrow schema, and how a finished request or a failed row becomes output columns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from batchrun.engine.request import Request
from batchrun.errors import JobError

# Parquet names a list's item "element"; using it here keeps parts equal to this schema on read.
_INT32_LIST = pa.list_(pa.field("element", pa.int32()))
_FLOAT32_LIST = pa.list_(pa.field("element", pa.float32()))
_TOP_LOGPROB = pa.struct(
    [pa.field("token_id", pa.int32(), nullable=False), pa.field("logprob", pa.float32(), False)]
)
_TOP_LOGPROBS = pa.list_(pa.field("element", pa.list_(pa.field("element", _TOP_LOGPROB))))


def _field(name: str, arrow_type: pa.DataType, nullable: bool, description: str) -> pa.Field:
    return pa.field(name, arrow_type, nullable=nullable, metadata={"description": description})


# The columns batchrun appends after the input's own columns, in this order.
OUTPUT_FIELDS: tuple[pa.Field, ...] = (
    _field(
        "row_index",
        pa.int64(),
        False,
        "Position of the input row in the whole input (files sorted by path); "
        "sort by it to restore input order.",
    ),
    _field(
        "sample_index",
        pa.int32(),
        False,
        "Which of the row's n samples this is, 0 .. n-1 (0 when n = 1); each has its own seed.",
    ),
    _field(
        "completion",
        pa.string(),
        True,
        "Decoded completion, special tokens skipped; null on error.",
    ),
    _field("completion_token_ids", _INT32_LIST, True, "Generated token ids; null on error."),
    _field("finish_reason", pa.string(), False, '"stop", "length" or "error".'),
    _field("prompt_tokens", pa.int32(), False, "Prompt length in tokens; 0 on error."),
    _field("completion_tokens", pa.int32(), False, "Generated tokens; 0 on error."),
    _field(
        "spec_rounds",
        pa.int32(),
        True,
        "Speculative verify rounds (0 without a draft); null on error.",
    ),
    _field(
        "spec_accept_hist",
        _INT32_LIST,
        True,
        "Length B (the draft block size): entry k-1 counts rounds that committed k tokens; "
        "null without a draft and on error.",
    ),
    _field(
        "acceptance_length",
        pa.float32(),
        True,
        "Tau: (completion_tokens - 1) / spec_rounds, the first token coming from the prefill; "
        "null without a draft, with 0 rounds, and on error.",
    ),
    _field("error", pa.string(), True, "Null, or why this row failed (it was not generated)."),
)

_PROCESSED = (
    "under the distribution the token was sampled from: log_softmax(logits / temperature) "
    "with the tokens top_k/top_p leave out at -inf, or log_softmax(logits) for a greedy row "
    "(vLLM's processed logprobs; the same with and without a draft)"
)
# Columns only a job that asks for them has (`logprobs`, `prompt_logprobs`), before `error`.
COMPLETION_LOGPROB_FIELDS: tuple[pa.Field, ...] = (
    _field(
        "completion_logprobs",
        _FLOAT32_LIST,
        True,
        f"With logprobs: each completion token's log-probability {_PROCESSED}; aligned with "
        "completion_token_ids. Null on error.",
    ),
    _field(
        "completion_logprob_sum",
        pa.float64(),
        True,
        "With logprobs: the sum of completion_logprobs (the completion's log-probability). "
        "Null on error.",
    ),
)
TOP_LOGPROBS_FIELD = _field(
    "top_logprobs",
    _TOP_LOGPROBS,
    True,
    "With logprobs = k > 0: per completion token, the k most probable tokens of the same "
    "distribution as completion_logprobs, by logprob descending (fewer where top_k/top_p keep "
    "fewer). Null on error.",
)
PROMPT_LOGPROBS_FIELD = _field(
    "prompt_logprobs",
    _FLOAT32_LIST,
    True,
    "With prompt_logprobs: each prompt token's log-probability under the target given the "
    "tokens before it, log_softmax(logits), whatever the sampling; prompt_tokens entries, the "
    "first null (nothing predicts it). Null on error.",
)


def output_fields(logprobs: int | None = None, prompt_logprobs: bool = False) -> list[pa.Field]:
    """The columns a job appends after the input's: OUTPUT_FIELDS with the log-probability
    columns it asks for (logprobs = k, None: off) before `error`."""
    extra = list(COMPLETION_LOGPROB_FIELDS) if logprobs is not None else []
    extra += [TOP_LOGPROBS_FIELD] if logprobs else []
    extra += [PROMPT_LOGPROBS_FIELD] if prompt_logprobs else []
    return [*OUTPUT_FIELDS[:-1], *extra, OUTPUT_FIELDS[-1]]


def output_schema(
    input_schema: pa.Schema, logprobs: int | None = None, prompt_logprobs: bool = False
) -> pa.Schema:
    """Every input column unchanged, in input order, then output_fields(...)."""
    fields = output_fields(logprobs, prompt_logprobs)
    names = [field.name for field in fields]
    collisions = [name for name in input_schema.names if name in names]
    if collisions:
        raise JobError(
            f"input column {collisions[0]!r} has the name of an output column; rename it "
            f"(output columns: {', '.join(names)})"
        )
    # Schema metadata (e.g. pandas') describes the input table, not ours: leave it out.
    return pa.schema(list(input_schema.remove_metadata()) + fields)


@dataclass(frozen=True)
class OutputRow:
    """Values of the output columns for one row (the log-probability ones: when asked for)."""

    row_index: int
    sample_index: int
    completion: str | None
    completion_token_ids: list[int] | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spec_rounds: int | None
    spec_accept_hist: list[int] | None
    acceptance_length: float | None
    error: str | None
    completion_logprobs: list[float] | None = None
    completion_logprob_sum: float | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None


def finished_row(request: Request) -> OutputRow:
    """The output of a request the engine finished."""
    if request.finish_reason is None:
        raise RuntimeError(f"engine returned row {request.row_index} without a finish_reason")
    completion_tokens = len(request.output_ids)
    tau = None
    if request.spec_hist is not None and request.spec_rounds > 0:
        tau = (completion_tokens - 1) / request.spec_rounds
    scored = request.logprobs
    tokens = scored.tokens if scored is not None else None
    return OutputRow(
        row_index=request.row_index,
        sample_index=request.sample_index,
        completion=request.completion,
        completion_token_ids=list(request.output_ids),
        finish_reason=request.finish_reason,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=completion_tokens,
        spec_rounds=request.spec_rounds,
        spec_accept_hist=list(request.spec_hist) if request.spec_hist is not None else None,
        acceptance_length=tau,
        error=None,
        completion_logprobs=list(tokens) if tokens is not None else None,
        completion_logprob_sum=sum(tokens) if tokens is not None else None,
        top_logprobs=scored.top if scored is not None else None,
        prompt_logprobs=scored.prompt if scored is not None else None,
    )


def error_rows(row_index: int, message: str, n: int = 1) -> list[OutputRow]:
    """The n output rows of an input row that cannot run (one per sample it would have had)."""
    return [error_row(row_index, message, i) for i in range(n)]


def error_row(row_index: int, message: str, sample_index: int = 0) -> OutputRow:
    return OutputRow(
        row_index=row_index,
        sample_index=sample_index,
        completion=None,
        completion_token_ids=None,
        finish_reason="error",
        prompt_tokens=0,
        completion_tokens=0,
        spec_rounds=None,
        spec_accept_hist=None,
        acceptance_length=None,
        error=message,
    )


def build_table(
    schema: pa.Schema, passthrough: Sequence[pa.RecordBatch], rows: Sequence[OutputRow]
) -> pa.Table:
    """One part: the input columns of each row (one-row batches) beside its output columns."""
    num_inputs = schema.get_field_index("row_index")  # the first output column
    input_columns = [
        pa.concat_arrays([batch.column(i) for batch in passthrough])
        if passthrough
        else pa.array([], type=schema.field(i).type)
        for i in range(num_inputs)
    ]
    output_columns = [
        pa.array([getattr(row, field.name) for row in rows], type=field.type)
        for field in list(schema)[num_inputs:]
    ]
    return pa.Table.from_arrays(input_columns + output_columns, schema=schema)
