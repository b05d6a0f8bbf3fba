"""OpenAI Batch request files (.jsonl) as input rows, read through the same path as Parquet.

Each non-blank line is one row with the columns of REQUEST_SCHEMA: its custom_id (the row id),
url and model, the chat `messages` or the completion `prompt`, one column per sampling setting
batchrun takes per row (the sampling declarations' override columns, under the OpenAI name where
it differs), and `request_error`. A line that is not JSON, not a request, or asks for what
batchrun does not do gets `request_error` saying so (the rest null), and the row becomes an error
row: a bad line never stops the job and is never dropped.

A file is indexed once at open (index_request_file: its sha256 and the byte offset of every group
of GROUP_ROWS lines, nothing parsed); those groups serve as its row groups, so shards and resume
read only their own groups, parsing each line once (read_request_rows). Before that, open_input
reads every file's custom_ids once (first_duplicate_id): OpenAI's Batch API refuses a file that
repeats one, and so does batchrun, across the files of one input too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.io.input.overrides import (
    BadOverride,
    convert_cell,
    override_kinds,
    show_value,
    token_bias_keys,
)
from batchrun.sampling.option import Kind

REQUEST_FILE_SUFFIX = ".jsonl"
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
GROUP_ROWS = 1024  # lines per row group: the unit shards and resume take
ID_COLUMN = "custom_id"
URL_COLUMN = "url"
MODEL_COLUMN = "model"
MESSAGES_COLUMN = "messages"
PROMPT_COLUMN = "prompt"
KWARGS_COLUMN = "chat_template_kwargs"
JSON_SCHEMA_COLUMN = "json_schema"
REQUEST_ERROR_COLUMN = "request_error"  # why the line is no request; null for a request
_REQUEST_KEYS = ("custom_id", "method", "url", "body")
_INT64_RANGE = (-(1 << 63), 1 << 63)
# A seed may be any integer in [-2^63, 2^64), which no Arrow integer holds: a decimal does, as
# for a Parquet seed column (values beyond it are the row's error, as there).
_SEED_TYPE = pa.decimal128(20, 0)
_SEED_RANGE = (-(10**20) + 1, 10**20)

# The per-row columns the sampling declarations make; a body field of the same name sets one.
SAMPLING_KINDS = override_kinds()
# Parquet names a list's item "element"; so the output parts read back with this schema.
_KIND_TYPES = {
    Kind.INT: pa.int64(),
    Kind.FLOAT: pa.float64(),
    Kind.BOOL: pa.bool_(),
    Kind.STRINGS: pa.list_(pa.field("element", pa.string())),
    Kind.TOKEN_IDS: pa.list_(pa.field("element", pa.int64())),
    Kind.TOKEN_BIAS: pa.string(),  # a JSON object, as a logit_bias column of a Parquet input
}
_MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
REQUEST_SCHEMA = pa.schema(
    [
        pa.field(ID_COLUMN, pa.string()),
        pa.field(URL_COLUMN, pa.string()),
        pa.field(MODEL_COLUMN, pa.string()),
        pa.field(MESSAGES_COLUMN, pa.list_(pa.field("element", _MESSAGE))),
        pa.field(PROMPT_COLUMN, pa.string()),
        pa.field(KWARGS_COLUMN, pa.string()),
        *(
            pa.field(name, _SEED_TYPE if name == "seed" else _KIND_TYPES[kind])
            for name, kind in SAMPLING_KINDS.items()
        ),
        pa.field(JSON_SCHEMA_COLUMN, pa.string()),
        pa.field(REQUEST_ERROR_COLUMN, pa.string()),
    ]
)
# OpenAI's names for batchrun's per-row settings where they differ (the others agree).
_RENAMED = {"max_completion_tokens": "max_tokens"}
# Fields that describe a request rather than shape its output: accepted, not used.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
_LOGPROBS_UNSUPPORTED = (
    "is not supported per request (the job's logprobs option adds log-probabilities to the "
    "Parquet output)"
)


class BadRequest(ValueError):
    """Why a line is not a request batchrun can run; its row's request_error."""


@dataclass(frozen=True)
class RequestFileIndex:
    """Where each row group of a request file starts: its byte offset and line number (from 1),
    its rows (non-blank lines), and the sha256 of the whole file (the job fingerprint's)."""

    group_offsets: tuple[int, ...]
    group_lines: tuple[int, ...]
    group_rows: tuple[int, ...]
    sha256: str


def is_request_file(path: Path) -> bool:
    return path.suffix.lower() == REQUEST_FILE_SUFFIX


def is_request_schema(schema: pa.Schema) -> bool:
    """Whether an input holds OpenAI Batch requests (a .jsonl file, or Parquet made from one)."""
    return {ID_COLUMN, URL_COLUMN, MESSAGES_COLUMN, PROMPT_COLUMN, REQUEST_ERROR_COLUMN} <= set(
        schema.names
    )


def index_request_file(path: Path) -> RequestFileIndex:
    """One pass over the bytes: the row groups of GROUP_ROWS non-blank lines, and the sha256."""
    digest = hashlib.sha256()
    offsets: list[int] = []
    lines: list[int] = []
    rows: list[int] = []
    offset = 0
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            digest.update(line)
            if line.strip():
                if not rows or rows[-1] == GROUP_ROWS:
                    offsets.append(offset)
                    lines.append(number)
                    rows.append(0)
                rows[-1] += 1
            offset += len(line)
    return RequestFileIndex(tuple(offsets), tuple(lines), tuple(rows), digest.hexdigest())


@dataclass(frozen=True)
class IdPlace:
    """Where a custom_id is: the file (as the user names it) and its line (from 1)."""

    file: str
    line: int


def first_duplicate_id(files: Sequence[tuple[str, Path]]) -> tuple[str, IdPlace, IdPlace] | None:
    """The first custom_id that two lines of these request files (shown name, path) share, with
    both places. Lines without a string custom_id are skipped: they become error rows anyway."""
    seen: dict[str, IdPlace] = {}
    for shown, path in files:
        with path.open("rb") as file:
            for number, line in enumerate(file, start=1):
                try:
                    custom_id = json.loads(line).get("custom_id") if line.strip() else None
                except (ValueError, AttributeError):  # not JSON, or not an object
                    continue
                if not isinstance(custom_id, str):
                    continue
                place = IdPlace(shown, number)
                if custom_id in seen:
                    return custom_id, seen[custom_id], place
                seen[custom_id] = place
    return None


def read_request_rows(
    path: Path,
    index: RequestFileIndex,
    group: int,
    batch_rows: int,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The rows of one row group, as record batches of batch_rows rows (of `columns`)."""
    schema = REQUEST_SCHEMA
    if columns is not None:
        schema = pa.schema([REQUEST_SCHEMA.field(name) for name in columns])
    left, number = index.group_rows[group], index.group_lines[group]
    rows: list[dict[str, Any]] = []
    with path.open("rb") as file:
        file.seek(index.group_offsets[group])
        while left:
            line = file.readline()
            if not line:
                raise OSError(f"{path} became shorter while it was read")
            if line.strip():
                rows.append(request_row(line, number))
                left -= 1
                if len(rows) == batch_rows or not left:
                    yield pa.RecordBatch.from_pylist(rows, schema=schema)
                    rows = []
            number += 1


def request_row(line: bytes, number: int) -> dict[str, Any]:
    """The columns of line `number`: its request's, or request_error saying why it is none
    (with its custom_id and url where it has them)."""
    known: dict[str, Any] = {}
    try:
        return _request_columns(line, known)
    except BadRequest as exc:
        return {**known, REQUEST_ERROR_COLUMN: f"line {number}: {exc}"}


def _request_columns(line: bytes, known: dict[str, Any]) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except ValueError as exc:  # a UnicodeDecodeError too
        raise BadRequest(f"not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise BadRequest(
            "not a request: a JSON object with custom_id, method, url and body expected, got "
            + show_value(request)
        )
    for key, column in (("custom_id", ID_COLUMN), ("url", URL_COLUMN)):
        if isinstance(request.get(key), str) and _encodes(request[key]):
            known[column] = request[key]
    _check_unicode(request)  # a lone surrogate escape has no UTF-8, which Arrow needs
    missing = [key for key in _REQUEST_KEYS if key not in request]
    if missing:
        raise BadRequest(f"not a request: it has no {', '.join(missing)}")
    _refuse_fields([key for key in request if key not in _REQUEST_KEYS], "")
    if ID_COLUMN not in known:
        raise BadRequest(f"custom_id must be a string, got {show_value(request['custom_id'])}")
    if request["method"] != "POST":
        raise BadRequest(f"method must be POST, got {show_value(request['method'])}")
    if request["url"] not in (CHAT_URL, COMPLETIONS_URL):
        raise BadRequest(
            f"url {show_value(request['url'])} is not supported "
            f"(batchrun runs {CHAT_URL} and {COMPLETIONS_URL})"
        )
    if not isinstance(request["body"], dict):
        raise BadRequest(f"body must be a JSON object, got {show_value(request['body'])}")
    return {**known, **body_columns(request["body"], chat=request["url"] == CHAT_URL)}


def _check_unicode(value: Any) -> None:
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        for text in (key, item):
            if isinstance(text, str) and not _encodes(text):
                raise BadRequest(f"holds text that is not valid Unicode: {show_value(text)}")
        if isinstance(item, (dict, list)):
            _check_unicode(item)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def body_columns(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """A request body as columns: its prompt, and its sampling fields as per-row settings.
    BadRequest names the fields batchrun does not support, or the first bad value."""
    fields = {name: value for name, value in body.items() if value is not None}  # null: unset
    prompt = MESSAGES_COLUMN if chat else PROMPT_COLUMN
    if prompt not in fields:
        raise BadRequest(f"body has no {prompt}")
    columns: dict[str, Any] = {}
    if chat:
        columns[MESSAGES_COLUMN] = _messages(fields.pop(MESSAGES_COLUMN))
    else:
        columns[PROMPT_COLUMN] = _prompt(fields.pop(PROMPT_COLUMN))
    if MODEL_COLUMN in fields:  # it names no model: the job's target runs every row
        model = fields.pop(MODEL_COLUMN)
        if not isinstance(model, str):
            raise BadRequest(f"model must be a string, got {show_value(model)}")
        columns[MODEL_COLUMN] = model
    special = _chat_fields if chat else _completion_fields
    unsupported = []
    for name, value in fields.items():
        column = _RENAMED.get(name, name)
        if name in _IGNORED:
            continue
        if column in SAMPLING_KINDS:
            if column in columns:
                raise BadRequest(f"{name} and {column} are both set; set one of them")
            columns[column] = _sampling_value(column, name, value)
        elif not special(name, value, fields, columns):
            unsupported.append(name)
    _refuse_fields(unsupported, " of the body")
    return columns


def _refuse_fields(names: Sequence[str], where: str) -> None:
    if names:
        listed = ", ".join(repr(name) for name in sorted(names))
        raise BadRequest(f"unsupported field{'s' if len(names) > 1 else ''}{where}: {listed}")


def _sampling_value(column: str, name: str, value: Any) -> Any:
    kind = SAMPLING_KINDS[column]
    if column == "stop" and isinstance(value, str):  # OpenAI takes one stop string alone
        value = [value]
    try:
        converted = convert_cell(kind, name, value)
    except BadOverride as exc:
        raise BadRequest(str(exc)) from None
    if column == "seed":
        if not _SEED_RANGE[0] <= converted < _SEED_RANGE[1]:
            raise BadRequest(f"seed must be an integer in [-2^63, 2^64), got {converted}")
        return Decimal(converted)
    if kind is Kind.INT and not _INT64_RANGE[0] <= converted < _INT64_RANGE[1]:
        raise BadRequest(f"{name} must fit in 64 bits, got {converted}")
    if kind is Kind.TOKEN_IDS and any(
        not _INT64_RANGE[0] <= token < _INT64_RANGE[1] for token in converted
    ):
        raise BadRequest(f"{name} holds a token id beyond 64 bits")
    if kind is Kind.TOKEN_BIAS:
        return json.dumps(token_bias_keys(converted))
    return list(converted) if isinstance(converted, tuple) else converted


def _shared_field(name: str, value: Any, fields: Mapping[str, Any]) -> bool:
    """Fields of both endpoints that are fine at values that change nothing."""
    if name == "stream":
        if value is not False:
            raise BadRequest("stream must be false: a batch returns whole results")
        return True
    if name == "best_of":
        if value != fields.get("n", 1):
            raise BadRequest("best_of is not supported beyond n")
        return True
    return False


def _chat_fields(name: str, value: Any, fields: Mapping[str, Any], columns: dict[str, Any]) -> bool:
    """A chat body's own fields into columns; False when batchrun does not support it."""
    if name == "logprobs":
        if value is not False:
            raise BadRequest(f"logprobs {_LOGPROBS_UNSUPPORTED}")
    elif name == "top_logprobs":
        if value != 0:
            raise BadRequest(f"top_logprobs {_LOGPROBS_UNSUPPORTED}")
    elif name == "response_format":
        schema = _response_schema(value)
        if schema is not None:
            columns[JSON_SCHEMA_COLUMN] = schema
    elif name == KWARGS_COLUMN:  # vLLM's: the chat template's arguments (enable_thinking)
        if not isinstance(value, dict):
            raise BadRequest(f"{KWARGS_COLUMN} must be a JSON object, got {show_value(value)}")
        columns[KWARGS_COLUMN] = json.dumps(value)
    else:
        return _shared_field(name, value, fields)
    return True


def _completion_fields(
    name: str, value: Any, fields: Mapping[str, Any], columns: dict[str, Any]
) -> bool:
    """A completion body's own fields; False when batchrun does not support it."""
    if name == "logprobs":
        raise BadRequest(f"logprobs {_LOGPROBS_UNSUPPORTED}")
    if name == "echo":
        if value is not False:
            raise BadRequest("echo must be false: the output holds the prompt apart")
        return True
    return _shared_field(name, value, fields)


def _response_schema(value: Any) -> str | None:
    """response_format as a json_schema cell (None: plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return json.dumps(schema, sort_keys=True)
        raise BadRequest("response_format json_schema needs json_schema.schema, a JSON object")
    raise BadRequest(
        "response_format must be of type text, json_object or json_schema, got " + show_value(value)
    )


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"messages must be a non-empty list, got {show_value(value)}")
    return [_message(number, message) for number, message in enumerate(value, start=1)]


def _message(number: int, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise BadRequest(f"message {number} must be a JSON object, got {show_value(message)}")
    _refuse_fields(
        [key for key in message if key not in ("role", "content")], f" of message {number}"
    )
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise BadRequest(f"message {number} needs a string role")
    if isinstance(content, list):  # content parts: batchrun's models read text only
        content = "\n".join(_text_part(number, part) for part in content)  # as vLLM joins them
    if not isinstance(content, str):
        raise BadRequest(f"message {number} needs string content, got {show_value(content)}")
    return {"role": role, "content": content}


def _text_part(number: int, part: Any) -> str:
    text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
    if not isinstance(text, str):
        raise BadRequest(f"message {number}: only text content parts are supported")
    return text


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:  # one prompt, in a list
        value = value[0]
    if isinstance(value, str):
        return value
    raise BadRequest(f"prompt must be one string, got {show_value(value)}")
