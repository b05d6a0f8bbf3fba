"""The job spec: what to run, resolved from defaults, a TOML job file and command-line flags."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa

from batchrun.engine.config import EngineConfig
from batchrun.engine.request import SamplingParams, row_seed
from batchrun.errors import JobError
from batchrun.io.chat_args import chat_kwargs_problem
from batchrun.io.output_schema import output_schema
from batchrun.io.overrides import BadOverride, logit_bias
from batchrun.io.prompts import CONSTRAINT_COLUMNS, THINKING_WITH_LOGPROBS
from batchrun.sampling.grammar import Constraint
from batchrun.sampling.grammar_compile import COMPILE_SECONDS, MAX_CONSTRAINT_BYTES, CompileBudget
from batchrun.schemas import job_schema

_FLOAT_CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
# Keys holding paths: relative ones in a job file resolve against the job file's directory.
_PATH_KEYS = ("input", "output", "target", "draft")


@dataclass(frozen=True)
class JobSpec:
    input: str
    output: str
    target: str
    draft: str | None = None  # None (or "none"): no draft
    prompt_column: str | None = None
    messages_column: str | None = None
    token_ids_column: str | None = None
    id_column: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    # Structured output of every row (at most one of them; a row's own columns replace it).
    json_schema: str | dict[str, Any] | None = None  # a JSON Schema, as JSON text or a table
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    # A constraint whose text is longer, or whose compile takes longer, is its row's error.
    max_constraint_bytes: int = MAX_CONSTRAINT_BYTES
    grammar_compile_timeout: float = COMPILE_SECONDS
    max_thinking_tokens: int | None = None  # a think block's budget; then its end is forced
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    min_p: float = 0.0
    logprobs: int | None = None  # None: off; k: each token's log-probability and its top k
    # None: off; K: each prompt token's log-probability and its top K (true is 0, false None)
    prompt_logprobs: int | None = None
    # Arguments to the chat template of `messages` rows (Qwen3: enable_thinking); a row's
    # chat_template_kwargs cell adds to them. thinking: enable_thinking, a shorthand.
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: bool | None = None
    reasoning_parser: str | None = None  # qwen3 | auto: the think block apart from the answer
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8
    cuda_graphs: bool = True
    verify_width: int | str = "auto"
    prefix_caching: bool = True
    max_batch_size: int = 64
    max_batched_tokens: int = 4096
    schedule_window: int = 4096
    gpu_memory_fraction: float = 0.9
    tp: int = 1  # tensor-parallel processes
    shard: str | None = None  # "I/N"
    overwrite: bool = False
    quiet: bool = False
    rows_per_part: int = 1000
    part_seconds: float = 60.0

    def __post_init__(self) -> None:
        # Normalise what TOML and callers hand us, then hold every JobSpec to the schema.
        if self.draft is not None and self.draft.lower() == "none":
            object.__setattr__(self, "draft", None)
        for name in ("stop", "stop_token_ids", "choice"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        validate_job_dict(self.to_dict())
        if isinstance(self.prompt_logprobs, bool):
            object.__setattr__(self, "prompt_logprobs", 0 if self.prompt_logprobs else None)
        object.__setattr__(self, "temperature", float(self.temperature))
        for name in ("top_p", *_FLOAT_CONTROLS):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "part_seconds", float(self.part_seconds))
        object.__setattr__(self, "grammar_compile_timeout", float(self.grammar_compile_timeout))
        object.__setattr__(self, "gpu_memory_fraction", float(self.gpu_memory_fraction))
        if self.shard is not None:
            parse_shard(self.shard)
        if self.max_thinking_tokens is not None and self.logprobs is not None:
            raise JobError(THINKING_WITH_LOGPROBS)
        set_keys = [k for k in CONSTRAINT_COLUMNS if getattr(self, k) is not None]
        if len(set_keys) > 1:
            raise JobError(f"job keys {set_keys[0]!r} and {set_keys[1]!r}: choose one")
        constraint = self.constraint()  # one the grammar would not hold rows to, say
        problem = constraint.problem() if constraint is not None else None
        if constraint is not None and problem is not None:
            raise JobError(f"job key {constraint.kind!r}: {problem}")
        problem = chat_kwargs_problem(self.chat_template_kwargs or {})
        if problem is not None:
            raise JobError(f"job key 'chat_template_kwargs': {problem}")
        # The schema lets NaN and inf through; hold the defaults to the check every row gets.
        try:
            params = self.default_params()
        except BadOverride as exc:
            raise JobError(f"job key 'logit_bias': {exc}") from None
        problem = params.problem()
        if problem is not None:
            raise JobError(f"job sampling default: {problem}")

    def to_dict(self) -> dict[str, Any]:
        """The job as job-file keys (None values left out, tuples as lists)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        """The schema of the job's output parts over this input: its columns, then the ones
        the job adds (with the reasoning and log-probability columns it asks for)."""
        reasoning = self.reasoning_parser is not None
        return output_schema(input_schema, self.logprobs, self.prompt_logprobs, reasoning)

    def chat_kwargs(self) -> dict[str, Any]:
        """The chat template's arguments: chat_template_kwargs, with thinking as enable_thinking."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking
        return kwargs

    @property
    def shard_spec(self) -> tuple[int, int] | None:
        """(I, N) of --shard I/N, or None."""
        return parse_shard(self.shard) if self.shard is not None else None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            target=Path(self.target),
            draft=Path(self.draft) if self.draft is not None else None,
            dtype=self.dtype,
            device=self.device,
            attention_backend=self.attention_backend,
            kv_cache_dtype=self.kv_cache_dtype,
            cuda_graphs=self.cuda_graphs,
            verify_width=self.verify_width,
            prefix_caching=self.prefix_caching,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            max_batch_size=self.max_batch_size,
            max_batched_tokens=self.max_batched_tokens,
            gpu_memory_fraction=self.gpu_memory_fraction,
            compile_budget=CompileBudget(self.grammar_compile_timeout, self.max_constraint_bytes),
        )

    def default_params(self, row_index: int | None = None) -> SamplingParams:
        """The job's sampling defaults; with a row_index, seeded for that row."""
        seed = self.seed if row_index is None else row_seed(self.seed, row_index)
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            n=self.n,
            ignore_eos=self.ignore_eos,
            max_thinking_tokens=self.max_thinking_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=logit_bias(self.logit_bias or {}),
            min_p=self.min_p,
            constraint=self.constraint(),
            reasoning=self.reasoning_parser is not None,
        )

    def constraint(self) -> Constraint | None:
        """The job's structured output (a table's schema as JSON text), or None."""
        if self.json_schema is not None:
            schema = self.json_schema
            text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
            return Constraint("json_schema", text)
        if self.regex is not None:
            return Constraint("regex", self.regex)
        return Constraint("choice", self.choice) if self.choice is not None else None


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) of "I/N"; the schema has already checked the form."""
    index, count = (int(part) for part in text.split("/"))
    if count < 1 or index >= count:
        raise JobError(f"job key 'shard': {text!r} needs 0 <= I < N")
    return index, count


def validate_job_dict(data: Mapping[str, Any]) -> None:
    """Raise JobError, naming the key, for the first way `data` breaks the job schema."""
    # Repeatable flags arrive as tuples; JSON Schema arrays are lists.
    data = {key: list(v) if isinstance(v, tuple) else v for key, v in data.items()}
    validator = jsonschema.Draft202012Validator(job_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is None:
        return
    if error.validator == "additionalProperties":
        known = job_schema()["properties"]
        unknown = sorted(key for key in data if key not in known)
        raise JobError(f"unknown job key {unknown[0]!r}")
    if error.validator == "required":
        missing = next(key for key in job_schema()["required"] if key not in data)
        flag = "--" + missing.replace("_", "-")
        raise JobError(f"job key {missing!r} is required (set it in the job file or with {flag})")
    key = error.absolute_path[0] if error.absolute_path else "?"
    raise JobError(f"job key {key!r}: {error.message}")


def read_job_file(path: Path) -> dict[str, Any]:
    """The keys of a TOML job file, with relative paths resolved against its directory."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise JobError(f"cannot read job file {str(path)!r}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise JobError(f"job file {str(path)!r} is not valid TOML: {exc}") from exc
    base = path.resolve().parent
    for key in _PATH_KEYS:
        value = data.get(key)
        if isinstance(value, str) and not (key == "draft" and value.lower() == "none"):
            # An absolute value replaces base; normpath keeps globs intact (no resolve()).
            data[key] = os.path.normpath(base / value)
    return data


def load_job(job_file: Path | None = None, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """Defaults < job file < overrides (None values in overrides are unset flags); its paths
    checked (check_path) before anything opens them."""
    data = read_job_file(job_file) if job_file is not None else {}
    data.update({key: value for key, value in (overrides or {}).items() if value is not None})
    validate_job_dict(data)
    job = JobSpec(**data)
    for key in _PATH_KEYS:
        value = getattr(job, key)
        if value is not None:
            check_path(key, value)
    return job


def check_path(key: str, path: str) -> None:
    """JobError, naming the job key, for a path the system cannot look up (OSError: a name or
    the whole path too long, a directory on the way that cannot be searched, a symlink loop)
    or could not create: a name, past the part that exists, longer than its filesystem allows.
    A path that does not exist yet passes; what else is wrong with it is for its own checks.
    Glob patterns pass the name-length check: a long pattern can match a short name."""
    try:
        os.stat(path)
        return
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise JobError(f"{key} path {_shown(path)}: {exc.strerror or exc}") from None
    absolute = os.path.abspath(path)
    existing = os.path.dirname(absolute)
    while not os.path.isdir(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    for name in Path(os.path.relpath(absolute, existing)).parts:
        size = len(os.fsencode(name))
        if size > name_max and not glob.has_magic(name):
            raise JobError(
                f"{key} path {_shown(path)}: a name of {size} bytes is longer than the "
                f"{name_max} its filesystem allows"
            )
    size = len(os.fsencode(absolute))
    if size >= path_max:
        raise JobError(
            f"{key} path {_shown(path)}: its absolute path is {size} bytes, more than the "
            f"{path_max - 1} the system allows"
        )


def _pathconf(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):  # no such limit here, or none the system names
        return default


def _shown(path: str) -> str:
    """The path for an error line: a long one cut in the middle, with its length."""
    if len(path) <= 80:
        return repr(path)
    return f"{path[:40] + '...' + path[-30:]!r} ({len(path)} characters)"
