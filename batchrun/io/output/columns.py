"""The output Arrow schema, and how a finished request or a failed row becomes output columns.

Every string of a part is valid UTF-8, whatever the input held (Parquet readers do not all check,
but polars and validating Arrow readers refuse a file with invalid UTF-8). A pass-through cell
that is not valid UTF-8 is written as its bytes decoded with `errors="replace"` (each invalid
sequence becomes U+FFFD), its row's `error` says so, and the part gets a binary column
`<column>__raw_bytes` holding the original bytes of the replaced cells (null in the other rows).
Checking costs one validation pass per string column of a part; only a column that fails it is
looked at cell by cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from batchrun.engine.core.requests import Request, round_tokens
from batchrun.errors import JobError
from batchrun.io.output.constraint_error import constraint_error

if TYPE_CHECKING:  # the split needs transformers: a job that asks for it has it loaded
    from batchrun.io.output.reasoning import ReasoningSplit

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
        "Speculation rounds: steps that verified drafts (a step of verify width 1 is plain "
        "decoding and is not one); 0 without a draft, null on error.",
    ),
    _field(
        "spec_accept_hist",
        _INT32_LIST,
        True,
        "Length B (the draft block size): entry k-1 counts rounds that committed k tokens; "
        "null without a draft and on error.",
    ),
    _field(
        "spec_capped_hist",
        _INT32_LIST,
        True,
        "Length B: entry k-1 counts rounds of verify width k that accepted every draft they "
        "verified (draft k was not verified): with spec_accept_hist, each draft's chance "
        "given the ones before; null without a draft and on error.",
    ),
    _field(
        "acceptance_length",
        pa.float32(),
        True,
        "Tau: tokens committed per speculation round (sum of k * spec_accept_hist[k-1] over "
        "spec_rounds); null without a draft, with 0 rounds, and on error.",
    ),
    _field(
        "error",
        pa.string(),
        True,
        'Null, or why this row failed (finish_reason "error": it was not generated). Also set '
        "on a generated row, which keeps its completion and finish_reason: when a stop row's "
        "completion breaks its constraint (json_schema, regex or choice), and when an input "
        "column's cell was not valid UTF-8: the output holds it decoded with U+FFFD "
        'replacements, and the message (appended after "; " to the row\'s error) is "invalid '
        "UTF-8 replaced with U+FFFD in the output: COLUMNS (original bytes in "
        'COLUMN__raw_bytes)".',
    ),
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
PROMPT_TOP_LOGPROBS_FIELD = _field(
    "prompt_top_logprobs",
    _TOP_LOGPROBS,
    True,
    "With prompt_logprobs = K > 0: per prompt token, the K most probable tokens of the same "
    "distribution as prompt_logprobs, by logprob descending; aligned with prompt_logprobs, the "
    "first null. Null on error.",
)


REASONING_FIELDS: tuple[pa.Field, ...] = (
    _field(
        "reasoning",
        pa.string(),
        True,
        "With reasoning_parser: the text of the completion's think block; null when it has none "
        "or on error (completion is then the answer after the block, null when the row ended "
        "inside it).",
    ),
    _field(
        "reasoning_tokens",
        pa.int32(),
        True,
        "With reasoning_parser: the tokens inside the think block. Null on error.",
    ),
)


def output_fields(
    logprobs: int | None = None, prompt_logprobs: int | None = None, reasoning: bool = False
) -> list[pa.Field]:
    """The columns a job appends after the input's: OUTPUT_FIELDS with the reasoning and
    log-probability columns it asks for (logprobs = k, prompt_logprobs = K; None: off) before
    `error`."""
    extra = list(REASONING_FIELDS) if reasoning else []
    extra += list(COMPLETION_LOGPROB_FIELDS) if logprobs is not None else []
    extra += [TOP_LOGPROBS_FIELD] if logprobs else []
    extra += [PROMPT_LOGPROBS_FIELD] if prompt_logprobs is not None else []
    extra += [PROMPT_TOP_LOGPROBS_FIELD] if prompt_logprobs else []
    return [*OUTPUT_FIELDS[:-1], *extra, OUTPUT_FIELDS[-1]]


def output_schema(
    input_schema: pa.Schema,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    reasoning: bool = False,
) -> pa.Schema:
    """Every input column unchanged, in input order, then output_fields(...). (A part whose
    input cells held invalid UTF-8 also has raw-bytes columns after these: see build_table.)"""
    fields = output_fields(logprobs, prompt_logprobs, reasoning)
    names = [field.name for field in fields]
    collisions = [name for name in input_schema.names if name in names]
    if collisions:
        raise JobError(
            f"input column {collisions[0]!r} has the name of an output column; rename it "
            f"(output columns: {', '.join(names)})"
        )
    for field in input_schema:
        raw = raw_bytes_name(field.name)
        if holds_strings(field.type) and raw in input_schema.names:
            raise JobError(
                f"input column {raw!r} has the name batchrun gives the original bytes of "
                f"{field.name!r} where a cell of it is not valid UTF-8; rename it"
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
    spec_capped_hist: list[int] | None
    acceptance_length: float | None
    error: str | None
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    completion_logprobs: list[float] | None = None
    completion_logprob_sum: float | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


def finished_row(request: Request, reasoning: ReasoningSplit | None = None) -> OutputRow:
    """The output of a request the engine finished; with `reasoning`, its think block apart."""
    out = request.output
    if out.finish_reason is None:
        raise RuntimeError(f"engine returned row {request.row_index} without a finish_reason")
    if out.error is not None:  # the engine could not generate it (its grammar)
        return error_row(request.row_index, out.error, request.sample_index)
    completion_tokens = len(out.token_ids)
    tau = None
    if out.spec_hist is not None and out.spec_rounds > 0:
        tau = round_tokens(out.spec_hist) / out.spec_rounds
    scored = out.logprobs
    tokens = scored.tokens if scored is not None else None
    thought, completion, thought_tokens = None, out.completion, None
    if reasoning is not None:
        thought, completion, thought_tokens = reasoning.split(request)
    return OutputRow(
        row_index=request.row_index,
        sample_index=request.sample_index,
        completion=completion,
        completion_token_ids=list(out.token_ids),
        finish_reason=out.finish_reason,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=completion_tokens,
        spec_rounds=out.spec_rounds,
        spec_accept_hist=list(out.spec_hist) if out.spec_hist is not None else None,
        spec_capped_hist=list(out.spec_capped) if out.spec_capped is not None else None,
        acceptance_length=tau,
        error=constraint_error(request, completion),
        reasoning=thought,
        reasoning_tokens=thought_tokens,
        completion_logprobs=list(tokens) if tokens is not None else None,
        completion_logprob_sum=sum(tokens) if tokens is not None else None,
        top_logprobs=scored.top if scored is not None else None,
        prompt_logprobs=scored.prompt if scored is not None else None,
        prompt_top_logprobs=scored.prompt_top if scored is not None else None,
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
        spec_capped_hist=None,
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
    table = pa.Table.from_arrays(input_columns + output_columns, schema=schema)
    return replace_invalid_utf8(table)


# Invalid UTF-8 in input columns (see the module's docstring).
RAW_BYTES_SUFFIX = "__raw_bytes"
REPLACED_NOTE = "invalid UTF-8 replaced with U+FFFD in the output"


def raw_bytes_name(column: str) -> str:
    """The column holding the original bytes of `column`'s cells that were not valid UTF-8."""
    return column + RAW_BYTES_SUFFIX


def holds_strings(arrow_type: pa.DataType) -> bool:
    """Whether values of the type hold strings that replace_invalid_utf8 checks: string,
    large_string and string_view, also inside list, large_list, fixed_size_list, map, struct
    and dictionary types, and as a top-level extension type's storage."""
    if isinstance(arrow_type, pa.BaseExtensionType):
        return _nested_strings(arrow_type.storage_type)
    return _nested_strings(arrow_type)


def _nested_strings(t: pa.DataType) -> bool:
    if _is_text(t):
        return True
    if _is_list_like(t) or pa.types.is_fixed_size_list(t):
        return _nested_strings(t.value_type)
    if pa.types.is_map(t):
        return _nested_strings(t.key_type) or _nested_strings(t.item_type)
    if pa.types.is_struct(t):
        return any(_nested_strings(field.type) for field in t)
    if pa.types.is_dictionary(t):
        return _nested_strings(t.value_type)
    return False


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list_like(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def raw_bytes_type(arrow_type: pa.DataType) -> pa.DataType:
    """The type of a raw-bytes column: the column's type with each string type replaced by
    its binary twin (string and string_view -> binary, large_string -> large_binary),
    dictionaries decoded and an extension type by its storage's."""
    t = arrow_type
    if isinstance(t, pa.BaseExtensionType):
        return raw_bytes_type(t.storage_type)
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_string_view(t):
        return pa.binary()  # pyarrow cannot `take` views
    if pa.types.is_list(t):
        return pa.list_(_raw_field(t.value_field))
    if pa.types.is_large_list(t):
        return pa.large_list(_raw_field(t.value_field))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_raw_field(t.value_field), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(_raw_field(t.key_field), _raw_field(t.item_field), t.keys_sorted)
    if pa.types.is_struct(t):
        return pa.struct([_raw_field(field) for field in t])
    if pa.types.is_dictionary(t):
        return raw_bytes_type(t.value_type)
    return t


def _raw_field(field: pa.Field) -> pa.Field:
    return field.with_type(raw_bytes_type(field.type))


def _raw_bytes(array: pa.Array) -> pa.Array:
    if isinstance(array, pa.ExtensionArray):
        return _raw_bytes(array.storage)
    return array.cast(raw_bytes_type(array.type))


def replace_invalid_utf8(table: pa.Table) -> pa.Table:
    """A part (input columns, then the output columns from row_index on) whose strings are all
    valid UTF-8: in each input column that holds a string that is not, each such string is
    decoded with U+FFFD replacements, the rows it was in say so in `error`, and a column
    raw_bytes_name(column) (type raw_bytes_type) is appended after the others, holding the
    original cell of those rows and null in the other rows. A table whose strings are all
    valid comes back as it is, after one validation pass over each string column."""
    num_inputs = table.schema.get_field_index("row_index")
    replaced: dict[int, list[str]] = {}  # row -> the columns replaced in it
    raw_columns: list[tuple[pa.Field, pa.Array]] = []
    for i in range(num_inputs):
        field = table.schema.field(i)
        if not holds_strings(field.type) or _valid(table.column(i)):
            continue
        array = table.column(i).combine_chunks()
        fixed, bad = _replace_invalid(array)
        if fixed is None:
            continue
        table = table.set_column(i, field, fixed)
        if bad is None or not bad.any():
            continue  # invalid bytes only under null slots: nothing a user had is replaced
        for row in np.flatnonzero(bad).tolist():
            replaced.setdefault(row, []).append(field.name)
        take = pa.array(np.arange(len(array)), mask=~bad)  # null (so a null cell) elsewhere
        raw_field = pa.field(
            raw_bytes_name(field.name),
            raw_bytes_type(field.type),
            nullable=True,
            metadata={
                "description": f"The original bytes of the cells of {field.name} that were not "
                f"valid UTF-8 (the output's {field.name} holds them decoded with U+FFFD "
                "replacements); null in every other row."
            },
        )
        raw_columns.append((raw_field, _raw_bytes(array).take(take)))
    if not replaced:
        return table
    at = table.schema.get_field_index("error")
    errors = table.column(at).to_pylist()
    for row, columns in replaced.items():
        raws = ", ".join(raw_bytes_name(name) for name in columns)
        note = f"{REPLACED_NOTE}: {', '.join(columns)} (original bytes in {raws})"
        errors[row] = note if errors[row] is None else f"{errors[row]}; {note}"
    error_field = table.schema.field(at)
    table = table.set_column(at, error_field, pa.array(errors, error_field.type))
    for raw_field, raw in raw_columns:
        table = table.append_column(raw_field, raw)
    return table


def _valid(column: pa.ChunkedArray | pa.Array) -> bool:
    try:
        column.validate(full=True)  # checks UTF-8 (pyarrow does not when reading Parquet)
    except pa.ArrowException:
        return False
    return True


def _replace_invalid(array: pa.Array) -> tuple[pa.Array | None, np.ndarray | None]:
    """(`array` with each string that is not valid UTF-8 decoded with U+FFFD replacements,
    or None if it needs no change; for each slot, whether its non-null value held such a
    string, or None if none did). Only strings change: everything else is kept as is."""
    t = array.type
    if isinstance(t, pa.BaseExtensionType):
        assert isinstance(array, pa.ExtensionArray)
        storage, bad = _replace_invalid(array.storage)
        return (
            (None, None) if storage is None else (pa.ExtensionArray.from_storage(t, storage), bad)
        )
    if _is_text(t):
        return _replace_text(array)
    if _is_list_like(t) or pa.types.is_map(t):
        return _replace_in_lists(array)
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        values = array.values.slice(array.offset * size, len(array) * size)
        fixed, bad = _replace_invalid(values)
        if fixed is None:
            return None, None
        rows = None if bad is None else np.asarray(bad.reshape(len(array), size).any(axis=1))
        rebuilt = pa.FixedSizeListArray.from_arrays(fixed, type=t, mask=_null_mask(array))
        return rebuilt, _where_valid(array, rows)
    if pa.types.is_struct(t):
        children = [array.field(i) for i in range(t.num_fields)]
        results = [_replace_invalid(child) for child in children]
        if all(fixed is None for fixed, _ in results):
            return None, None
        rebuilt = pa.StructArray.from_arrays(
            [
                c if fixed is None else fixed
                for c, (fixed, _) in zip(children, results, strict=True)
            ],
            fields=list(t),
            mask=_null_mask(array),
        )
        return rebuilt, _where_valid(array, _any([bad for _, bad in results]))
    if pa.types.is_dictionary(t):
        assert isinstance(array, pa.DictionaryArray)
        dictionary, bad = _replace_invalid(array.dictionary)
        if dictionary is None:
            return None, None
        rebuilt = pa.DictionaryArray.from_arrays(array.indices, dictionary, ordered=t.ordered)
        rows = None
        if bad is not None:
            indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
            rows = bad[indices]
        return rebuilt, _where_valid(array, rows)
    return None, None


def _replace_text(array: pa.Array) -> tuple[pa.Array | None, np.ndarray | None]:
    if _valid(array):
        return None, None
    texts: list[str | None] = []
    bad = np.zeros(len(array), dtype=bool)
    for i, value in enumerate(_raw_bytes(array).to_pylist()):
        if value is None:
            texts.append(None)
            continue
        try:
            texts.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            texts.append(value.decode("utf-8", errors="replace"))
            bad[i] = True
    return pa.array(texts, array.type), bad


def _replace_in_lists(array: pa.Array) -> tuple[pa.Array | None, np.ndarray | None]:
    """list, large_list and map arrays: their child arrays over the array's own range."""
    t = array.type
    offsets = array.offsets.to_numpy()
    start, stop = int(offsets[0]), int(offsets[-1])
    is_map = pa.types.is_map(t)
    children = [array.keys, array.items] if is_map else [array.values]
    children = [child.slice(start, stop - start) for child in children]
    results = [_replace_invalid(child) for child in children]
    if all(fixed is None for fixed, _ in results):
        return None, None
    fixed = [c if f is None else f for c, (f, _) in zip(children, results, strict=True)]
    local = (offsets - start).astype(offsets.dtype)
    relative = pa.array(local)
    mask = _null_mask(array)
    if is_map:
        rebuilt = pa.MapArray.from_arrays(relative, fixed[0], fixed[1], type=t, mask=mask)
    elif pa.types.is_list(t):
        rebuilt = pa.ListArray.from_arrays(relative, fixed[0], type=t, mask=mask)
    else:
        rebuilt = pa.LargeListArray.from_arrays(relative, fixed[0], type=t, mask=mask)
    child_bad = _any([bad for _, bad in results])
    rows = None
    if child_bad is not None:
        counts = np.concatenate([[0], np.cumsum(child_bad)])
        rows = counts[local[1:]] - counts[local[:-1]] > 0
    return rebuilt, _where_valid(array, rows)


def _any(masks: Sequence[np.ndarray | None]) -> np.ndarray | None:
    present = [mask for mask in masks if mask is not None]
    if not present:
        return None
    return np.logical_or.reduce(present) if len(present) > 1 else present[0]


def _null_mask(array: pa.Array) -> pa.Array | None:
    return array.is_null() if array.null_count else None


def _where_valid(array: pa.Array, rows: np.ndarray | None) -> np.ndarray | None:
    """rows, false at the array's null slots (what a null hides is nobody's data)."""
    if rows is None:
        return None
    return rows & array.is_valid().to_numpy(zero_copy_only=False)


def conform_part(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Output rows (build_table's, or a Ray actor's) as a part of the job whose output schema
    is `schema`: its columns, cast to it, then the table's raw-bytes columns, if any."""
    raw = [
        name
        for name in table.column_names
        if name.endswith(RAW_BYTES_SUFFIX) and name not in schema.names
    ]
    conformed = table.select(schema.names).cast(schema)
    for name in raw:
        conformed = conformed.append_column(table.schema.field(name), table.column(name))
    return conformed


def concat_parts(tables: Sequence[pa.Table]) -> pa.Table:
    """Tables of one job's output rows as one part: a raw-bytes column that only some of them
    have is null in the rows of the others."""
    return pa.concat_tables(tables, promote_options="default")
