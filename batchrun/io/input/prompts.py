"""Input rows to engine requests: find the prompt column, tokenize, apply per-row overrides.

A row that cannot become a request yields an error string instead; it becomes an error row in
the output, and the job goes on. No cell can do more: whatever its type or content, and whatever
the tokenizer raises on it, the worst it makes is its own row's error.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from batchrun.engine.core.requests import Request, row_seed
from batchrun.errors import JobError
from batchrun.io.input.cells import BadCell, row_values, without_nulls
from batchrun.io.input.chat_args import chat_kwargs_problem
from batchrun.io.input.openai_batch import (
    ID_COLUMN,
    MESSAGES_COLUMN,
    PROMPT_COLUMN,
    REQUEST_ERROR_COLUMN,
    is_request_schema,
)
from batchrun.io.input.overrides import (
    OVERRIDE_COLUMNS,
    BadOverride,
    convert_override,
    for_engine,
    output_rows,
    show_value,
)
from batchrun.io.input.prompt_bound import fewest_tokens, longest_token_chars
from batchrun.models.tokenizer import think_token_ids
from batchrun.sampling.constraint import KINDS, Constraint
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptKind(enum.Enum):
    TEXT = "text"
    MESSAGES = "messages"
    TOKEN_IDS = "token_ids"
    # OpenAI Batch requests: a chat row's messages or a completion row's prompt, or the line's
    # request_error (batchrun/io/input/openai_batch.py).
    REQUESTS = "openai_batch"


CHAT_KWARGS_COLUMN = "chat_template_kwargs"  # a messages row's own template arguments
CONSTRAINT_COLUMNS = KINDS  # a row's structured output: json_schema, regex or choice
THINKING_NEEDS_TOKENS = "max_thinking_tokens needs <think> and </think> tokens in the tokenizer"
THINKING_WITH_LOGPROBS = (
    "max_thinking_tokens and logprobs do not go together: forced tokens have no probabilities"
)
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


@dataclass(frozen=True)
class PromptColumn:
    kind: PromptKind
    name: str


# The prompt of an OpenAI Batch request, by whether it is a chat request.
_REQUEST_PROMPTS = {
    True: PromptColumn(PromptKind.MESSAGES, MESSAGES_COLUMN),
    False: PromptColumn(PromptKind.TEXT, PROMPT_COLUMN),
}


class PromptSettings(Protocol):
    """The job's prompt column settings (its input part): at most one is set."""

    @property
    def prompt_column(self) -> str | None: ...
    @property
    def messages_column(self) -> str | None: ...
    @property
    def token_ids_column(self) -> str | None: ...


@dataclass(frozen=True)
class RowDefaults:
    """What a row gets where its cells say nothing: the job's sampling defaults (seeded with
    the job seed), its chat template arguments, and whether the job asks for logprobs."""

    sampling: SamplingParams
    chat_kwargs: Mapping[str, Any]
    logprobs: bool

    def params(self, row_index: int) -> SamplingParams:
        """The defaults seeded for this row."""
        return dataclasses.replace(self.sampling, seed=row_seed(self.sampling.seed, row_index))


def find_prompt_column(schema: pa.Schema, settings: PromptSettings) -> PromptColumn:
    """The one prompt column: named by a flag, else whichever default name exists (OpenAI
    Batch requests: their own)."""
    named = [
        PromptColumn(kind, getattr(settings, flag))
        for kind, flag in _KIND_FLAGS.items()
        if getattr(settings, flag) is not None
    ]
    if is_request_schema(schema):
        if named:
            raise JobError(
                f"{_KIND_FLAGS[named[0].kind]} does not apply to OpenAI Batch requests: "
                "each takes its prompt from its body"
            )
        return PromptColumn(PromptKind.REQUESTS, MESSAGES_COLUMN)
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


def find_id_column(schema: pa.Schema, id_column: str | None) -> str | None:
    if id_column is None and is_request_schema(schema):
        return ID_COLUMN
    if id_column is not None and id_column not in schema.names:
        raise JobError(
            f"id_column {id_column!r} is not an input column "
            f"(input columns: {', '.join(schema.names)})"
        )
    return id_column


class RequestBuilder:
    """Turns the Python values of one input row into a Request, or says why it cannot."""

    def __init__(
        self,
        defaults: RowDefaults,
        prompt: PromptColumn,
        schema: pa.Schema,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        vocab_size: int,
        grammars: Callable[[], Grammars] | None = None,
    ) -> None:
        """grammars: the engine's structured-output compiler (made when first called), which
        starts compiling a row's constraint as the row is read; its cache then serves the
        engine."""
        if prompt.kind is PromptKind.MESSAGES and not getattr(tokenizer, "chat_template", None):
            raise JobError(
                f"prompt column {prompt.name!r} holds chat messages, "
                "but the target's tokenizer has no chat template"
            )
        self.defaults = defaults
        self.prompt = prompt
        self.overrides = tuple(name for name in OVERRIDE_COLUMNS if name in schema.names)
        self.constraints = tuple(name for name in CONSTRAINT_COLUMNS if name in schema.names)
        self.grammars = grammars
        self.chat_kwargs = dict(defaults.chat_kwargs)
        # A messages row's own template arguments, over the job's.
        self.kwargs_column = (
            CHAT_KWARGS_COLUMN
            if prompt.kind in (PromptKind.MESSAGES, PromptKind.REQUESTS)
            and CHAT_KWARGS_COLUMN in schema.names
            else None
        )
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.longest_token = longest_token_chars(tokenizer)  # for the bound before tokenizing

    @property
    def columns(self) -> list[str]:
        """The input columns `build` reads."""
        extra = [*self.overrides, *self.constraints]
        extra += [self.kwargs_column] if self.kwargs_column else []
        if self.prompt.kind is PromptKind.REQUESTS:
            extra += [PROMPT_COLUMN, REQUEST_ERROR_COLUMN]
        return [self.prompt.name, *(c for c in extra if c != self.prompt.name)]

    def build_batch(
        self, batch: pa.RecordBatch, row_indices: Sequence[int], extra_columns: Sequence[str] = ()
    ) -> list[tuple[dict[str, Any], Request | str]]:
        """For each row of `batch` (whose row_index is row_indices[i]): its values of the columns
        `build` reads and of extra_columns (an id column, for logs), and its request or why not."""
        columns = [*self.columns, *(c for c in extra_columns if c not in self.columns)]
        values = row_values(batch, columns)  # a bad cell spoils only its own row
        return [
            (row, self.build(row_index, row))
            for row_index, row in zip(row_indices, values, strict=True)
        ]

    def build(self, row_index: int, values: Mapping[str, Any]) -> Request | str:
        column = self.prompt
        if column.kind is PromptKind.REQUESTS:  # the line's own kind of prompt, or its error
            if values[REQUEST_ERROR_COLUMN] is not None:
                return str(values[REQUEST_ERROR_COLUMN])
            chat = values[MESSAGES_COLUMN] is not None
            column = _REQUEST_PROMPTS[chat]
            if chat and not getattr(self.tokenizer, "chat_template", None):
                return "a chat request needs a chat template, which the target's tokenizer lacks"
        params = self._params(row_index, values)
        if isinstance(params, str):
            return params
        prompt_ids = self._prompt_ids(column, values)
        if isinstance(prompt_ids, str):
            return prompt_ids
        if len(prompt_ids) >= self.max_model_len:
            return self._too_long(f"{len(prompt_ids)} tokens")
        return Request(row_index=row_index, prompt_ids=prompt_ids, params=params)

    def output_rows(self, values: Mapping[str, Any]) -> int:
        """How many output rows the row makes, whether it runs or is an error: its n, or 1
        when that n is itself invalid."""
        return output_rows(values["n"] if "n" in self.overrides else None, self.defaults.sampling.n)

    def _too_long(self, tokens: str) -> str:
        return f"prompt is too long: {tokens}; the model's context is {self.max_model_len}"

    def _too_many_chars(self, chars: int) -> str | None:
        """The error for a text that cannot fit whatever its tokens, else None (tokenize it)."""
        at_least = fewest_tokens(chars, self.longest_token)
        if at_least < self.max_model_len:
            return None
        return self._too_long(f"at least {at_least} tokens ({chars} characters)")

    @functools.cached_property
    def think(self) -> tuple[int, int] | None:
        """The tokenizer's think token ids, looked up when a row first needs them."""
        return think_token_ids(self.tokenizer)

    def _params(self, row_index: int, values: Mapping[str, Any]) -> SamplingParams | str:
        try:
            changes = {
                name: convert_override(name, values[name])
                for name in self.overrides
                if values[name] is not None
            }
            constraint = self._row_constraint(values)
        except BadOverride as exc:
            return str(exc)
        if constraint is not None:
            changes["constraint"] = constraint
        params = dataclasses.replace(self.defaults.params(row_index), **changes)
        if params.max_thinking_tokens is not None:
            if self.think is None:
                return THINKING_NEEDS_TOKENS
            if self.defaults.logprobs:
                return THINKING_WITH_LOGPROBS
        problem = params.problem() or params.vocab_problem(self.vocab_size)
        if problem is None and params.constraint is not None:
            problem = self._start_compile(params.constraint)
        return problem or for_engine(params, self.vocab_size)

    def _row_constraint(self, values: Mapping[str, Any]) -> Constraint | None:
        """The row's own structured output (None: the job's); BadOverride when its cells are
        of the wrong type or more than one is set."""
        cells = {name: values[name] for name in self.constraints if values[name] is not None}
        if len(cells) > 1:
            first, second = list(cells)[:2]
            raise BadOverride(f"{first} and {second} are both set; a row takes one of them")
        if not cells:
            return None
        ((kind, cell),) = cells.items()
        if isinstance(cell, BadCell):
            raise BadOverride(f"{kind} {cell.reason}")
        if kind == "choice":
            if isinstance(cell, list) and all(isinstance(c, str) for c in cell):
                return Constraint(kind, tuple(cell))
            raise BadOverride(f"choice must be a list of strings, got {show_value(cell)}")
        if kind == "json_schema" and isinstance(cell, dict):  # a struct column
            return Constraint(kind, json.dumps(without_nulls(cell), sort_keys=True))
        if isinstance(cell, str):
            return Constraint(kind, cell)
        raise BadOverride(f"{kind} must be a string, got {show_value(cell)}")

    def _start_compile(self, constraint: Constraint) -> str | None:
        if self.grammars is None:
            return "structured outputs are not available here"
        # Not waited for: the engine admits the row once its grammar is ready, or makes it an
        # error row when it does not compile, and no other row waits for it.
        self.grammars().submit(constraint)
        return None

    def _prompt_ids(self, column: PromptColumn, row: Mapping[str, Any]) -> list[int] | str:
        name, value = column.name, row[column.name]
        if value is None:
            return f"{name} is null"
        if isinstance(value, BadCell):
            return f"{name} {value.reason}"
        if len(value) == 0:
            return f"{name} is empty"
        if column.kind is PromptKind.TOKEN_IDS:
            return self._check_token_ids(value)
        if column.kind is PromptKind.MESSAGES:
            kwargs = self._chat_kwargs(row.get(self.kwargs_column) if self.kwargs_column else None)
            return kwargs if isinstance(kwargs, str) else self._render_chat(name, value, kwargs)
        too_long = self._too_many_chars(len(value))
        if too_long is not None:
            return too_long
        try:
            ids = list(self.tokenizer.encode(value))
        except BaseException as exc:
            if not _is_row_failure(exc):
                raise
            return f"tokenization failed: {exc}"
        return ids or f"{name} is empty after tokenization"

    def _check_token_ids(self, ids: list[Any]) -> list[int] | str:
        if len(ids) >= self.max_model_len:  # before looking at each of maybe millions of ids
            return self._too_long(f"{len(ids)} tokens")
        for token in ids:
            if token is None:
                return f"{self.prompt.name} holds a null token id"
            if not 0 <= token < self.vocab_size:
                return f"token id {token} is outside the vocabulary [0, {self.vocab_size})"
        return list(ids)

    def _chat_kwargs(self, cell: Any) -> dict[str, Any] | str:
        """The job's template arguments with the row's cell over them (a JSON object string,
        or a struct: its fields null in this row left out), or the row's error."""
        if cell is None:
            return self.chat_kwargs
        if isinstance(cell, BadCell):
            return f"{CHAT_KWARGS_COLUMN} {cell.reason}"
        if isinstance(cell, str):
            try:
                cell = json.loads(cell)
            except ValueError:
                return f"{CHAT_KWARGS_COLUMN} is not JSON: {cell[:80]!r}"
        if not isinstance(cell, dict):
            return f"{CHAT_KWARGS_COLUMN} must be a JSON object"
        reserved = chat_kwargs_problem(cell)
        if reserved is not None:
            return f"{CHAT_KWARGS_COLUMN}: {reserved}"
        return self.chat_kwargs | {k: v for k, v in cell.items() if v is not None}

    def _render_chat(
        self, name: str, messages: list[Any], kwargs: dict[str, Any]
    ) -> list[int] | str:
        for number, message in enumerate(messages, start=1):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                return f"malformed chat row: message {number} needs a string role and content"
        too_long = self._too_many_chars(sum(len(message["content"]) for message in messages))
        if too_long is not None:
            return too_long
        # Extra struct fields of other rows come back as None; templates expect them absent.
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            rendered: Any = self.tokenizer.apply_chat_template(
                cleaned, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
            )
        except BaseException as exc:  # a template error is a row error, whatever its type
            if not _is_row_failure(exc):
                raise
            return f"chat template failed: {exc}"
        if isinstance(rendered, Mapping):
            rendered = rendered["input_ids"]
        ids = [int(token) for token in rendered]
        return ids or f"{name} renders to no tokens"


def template_thinks(tokenizer: PreTrainedTokenizerBase) -> bool | None:
    """Whether the tokenizer's chat template thinks by default (Qwen3's does): None when it has
    no enable_thinking switch, i.e. its prompt does not change with it."""
    probe = [{"role": "user", "content": "hi"}]

    def render(**kwargs: Any) -> Any:
        return tokenizer.apply_chat_template(
            probe, add_generation_prompt=True, tokenize=False, **kwargs
        )

    try:
        default, off, on = render(), render(enable_thinking=False), render(enable_thinking=True)
    except Exception:  # no template, or one that needs more than a plain user turn
        return None
    return None if off == on else default == on


def _is_row_failure(exc: BaseException) -> bool:
    """An exception that fails one row: any Exception, or the PanicException (a BaseException)
    that a Rust tokenizer raises when it panics; interrupts and exits still stop the job."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"
