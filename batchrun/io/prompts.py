"""Input rows to engine requests: find the prompt column, tokenize, apply per-row overrides.

A row that cannot become a request yields an error string instead; it becomes an error row in
the output, and the job goes on.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchrun.engine.request import Request, SamplingParams
from batchrun.errors import JobError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchrun.job import JobSpec


class PromptKind(enum.Enum):
    TEXT = "text"
    MESSAGES = "messages"
    TOKEN_IDS = "token_ids"


DEFAULT_PROMPT_COLUMNS = {
    PromptKind.TEXT: "prompt",
    PromptKind.MESSAGES: "messages",
    PromptKind.TOKEN_IDS: "prompt_token_ids",
}
_KIND_FLAGS = {
    PromptKind.TEXT: "prompt_column",
    PromptKind.MESSAGES: "messages_column",
    PromptKind.TOKEN_IDS: "token_ids_column",
}
# Optional input columns whose non-null cells override the job's sampling defaults.
OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")
_INT_OVERRIDES = ("max_tokens", "top_k", "seed")
_FLOAT_OVERRIDES = ("temperature", "top_p")


@dataclass(frozen=True)
class PromptColumn:
    kind: PromptKind
    name: str


def find_prompt_column(schema: pa.Schema, job: JobSpec) -> PromptColumn:
    """The one prompt column: named by a flag, else whichever default name exists."""
    named = [
        PromptColumn(kind, getattr(job, flag))
        for kind, flag in _KIND_FLAGS.items()
        if getattr(job, flag) is not None
    ]
    if len(named) > 1:
        raise JobError("set only one of prompt_column, messages_column and token_ids_column")
    if named:
        column = named[0]
        if column.name not in schema.names:
            flag = _KIND_FLAGS[column.kind]
            raise JobError(
                f"{flag} {column.name!r} is not an input column "
                f"(input columns: {', '.join(schema.names)})"
            )
    else:
        found = [
            PromptColumn(kind, name)
            for kind, name in DEFAULT_PROMPT_COLUMNS.items()
            if name in schema.names
        ]
        defaults = ", ".join(repr(name) for name in DEFAULT_PROMPT_COLUMNS.values())
        if not found:
            raise JobError(
                f"no prompt column: the input needs one of {defaults}, or name one with "
                f"--prompt-column, --messages-column or --token-ids-column "
                f"(input columns: {', '.join(schema.names)})"
            )
        if len(found) > 1:
            raise JobError(
                f"input has several prompt columns ({', '.join(c.name for c in found)}); "
                "choose one with --prompt-column, --messages-column or --token-ids-column"
            )
        column = found[0]
    _check_prompt_type(column, schema.field(column.name).type)
    return column


def _check_prompt_type(column: PromptColumn, arrow_type: pa.DataType) -> None:
    if column.kind is PromptKind.TEXT:
        ok = pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
        expected = "string"
    elif column.kind is PromptKind.TOKEN_IDS:
        ok = _is_list(arrow_type) and pa.types.is_integer(arrow_type.value_type)
        expected = "list<int>"
    else:
        ok = (
            _is_list(arrow_type)
            and pa.types.is_struct(arrow_type.value_type)
            and {"role", "content"} <= {f.name for f in arrow_type.value_type}
        )
        expected = "list<struct<role: string, content: string>>"
    if not ok:
        raise JobError(f"prompt column {column.name!r} must be {expected}, found {arrow_type}")


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)


def find_id_column(schema: pa.Schema, job: JobSpec) -> str | None:
    if job.id_column is not None and job.id_column not in schema.names:
        raise JobError(
            f"id_column {job.id_column!r} is not an input column "
            f"(input columns: {', '.join(schema.names)})"
        )
    return job.id_column


class RequestBuilder:
    """Turns the Python values of one input row into a Request, or says why it cannot."""

    def __init__(
        self,
        job: JobSpec,
        prompt: PromptColumn,
        schema: pa.Schema,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        if prompt.kind is PromptKind.MESSAGES and not getattr(tokenizer, "chat_template", None):
            raise JobError(
                f"prompt column {prompt.name!r} holds chat messages, "
                "but the target's tokenizer has no chat template"
            )
        self.job = job
        self.prompt = prompt
        self.overrides = tuple(name for name in OVERRIDE_COLUMNS if name in schema.names)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    @property
    def columns(self) -> list[str]:
        """The input columns `build` reads."""
        return [self.prompt.name, *(c for c in self.overrides if c != self.prompt.name)]

    def build(self, row_index: int, values: Mapping[str, Any]) -> Request | str:
        params = self._params(row_index, values)
        if isinstance(params, str):
            return params
        prompt_ids = self._prompt_ids(values[self.prompt.name])
        if isinstance(prompt_ids, str):
            return prompt_ids
        if len(prompt_ids) >= self.max_model_len:
            return (
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}"
            )
        return Request(row_index=row_index, prompt_ids=prompt_ids, params=params)

    def _params(self, row_index: int, values: Mapping[str, Any]) -> SamplingParams | str:
        try:
            changes = {
                name: _convert_override(name, values[name])
                for name in self.overrides
                if values[name] is not None
            }
        except _BadCell as exc:
            return str(exc)
        params = dataclasses.replace(self.job.default_params(row_index), **changes)
        return params.problem() or params

    def _prompt_ids(self, value: Any) -> list[int] | str:
        name = self.prompt.name
        if value is None:
            return f"{name} is null"
        if len(value) == 0:
            return f"{name} is empty"
        if self.prompt.kind is PromptKind.TOKEN_IDS:
            return self._check_token_ids(value)
        if self.prompt.kind is PromptKind.MESSAGES:
            return self._render_chat(value)
        ids = list(self.tokenizer.encode(value))
        return ids or f"{name} is empty after tokenization"

    def _check_token_ids(self, ids: list[Any]) -> list[int] | str:
        for token in ids:
            if token is None:
                return f"{self.prompt.name} holds a null token id"
            if not 0 <= token < self.vocab_size:
                return f"token id {token} is outside the vocabulary [0, {self.vocab_size})"
        return list(ids)

    def _render_chat(self, messages: list[Any]) -> list[int] | str:
        for number, message in enumerate(messages, start=1):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                return f"malformed chat row: message {number} needs a string role and content"
        # Extra struct fields of other rows come back as None; templates expect them absent.
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            rendered: Any = self.tokenizer.apply_chat_template(
                cleaned, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # a template error is a row error, whatever its type
            return f"chat template failed: {exc}"
        if isinstance(rendered, Mapping):
            rendered = rendered["input_ids"]
        ids = [int(token) for token in rendered]
        return ids or f"{self.prompt.name} renders to no tokens"


class _BadCell(ValueError):
    """An override cell of the wrong type; the message is the row's error."""


def _convert_override(name: str, value: Any) -> Any:
    """The cell as the type SamplingParams wants; _BadCell when it has the wrong type."""
    if name in _INT_OVERRIDES:
        number = _as_int(value)
        if number is None:
            raise _BadCell(f"{name} must be an integer, got {value!r}")
        return number
    if name in _FLOAT_OVERRIDES:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _BadCell(f"{name} must be a number, got {value!r}")
    if name == "stop":
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise _BadCell(f"stop must be a list of strings, got {value!r}")
    ids = [_as_int(token) for token in value] if isinstance(value, list) else [None]
    if any(token is None for token in ids):
        raise _BadCell(f"stop_token_ids must be a list of integers, got {value!r}")
    return tuple(ids)


def _as_int(value: Any) -> int | None:
    # Integral floats are accepted: pandas stores an int column with nulls as float64.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None
