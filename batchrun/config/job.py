"""The job spec: what to run, in parts, resolved from defaults, a TOML job file and flags, and
held to the job's rules once, as it is built."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa

from batchrun.config.options import job_options, part_types
from batchrun.config.parts import (
    EnginePart,
    InputPart,
    OutputPart,
    RunPart,
    StructuredPart,
    parse_shard,
)
from batchrun.config.paths import PATH_KEYS, check_path, resolve_paths
from batchrun.config.schema import job_schema
from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import row_seed
from batchrun.engine.options import engine_options
from batchrun.errors import JobError
from batchrun.io.input.chat_args import chat_kwargs_problem
from batchrun.io.input.overrides import BadOverride, token_bias, token_bias_keys
from batchrun.io.input.prompts import THINKING_WITH_LOGPROBS, RowDefaults
from batchrun.io.output.columns import output_schema
from batchrun.sampling.constraint import KINDS, Constraint
from batchrun.sampling.option import Kind
from batchrun.sampling.params import SamplingParams


@dataclass(frozen=True)
class JobSpec:
    """A job in parts: where rows come from (input), where and what is written (output), the
    engine's settings (engine), the job's sampling defaults seeded with the job seed (sampling,
    its constraint the structured part's), the structured output as written (structured) and
    this process's share (run). from_keys and load_job hold the keys to the schema and the
    job's rules; a JobSpec changed with dataclasses.replace is trusted to keep them."""

    input: InputPart
    output: OutputPart
    engine: EnginePart
    sampling: SamplingParams = SamplingParams()
    structured: StructuredPart = field(default_factory=StructuredPart)
    run: RunPart = field(default_factory=RunPart)

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any]) -> JobSpec:
        """The job of these job-file keys (flat, as in TOML; a None value is an unset key), or
        JobError for the first key that breaks the schema or a rule."""
        keys = {key: value for key, value in keys.items() if value is not None}
        validate_job_dict(keys)
        values = {key: _normalized(key, value) for key, value in keys.items()}
        types = part_types()
        parts: dict[str, dict[str, Any]] = {name: {} for name in types}
        for option in job_options():
            if option.key in values:
                parts[option.part][option.field] = values[option.key]
        sampling = parts.pop("sampling")
        built = {name: kind(**parts[name]) for name, kind in types.items() if name != "sampling"}
        _check_rules(built, thinking_budget=sampling.get("max_thinking_tokens"))
        for option in job_options():
            if option.spec.kind is Kind.TOKEN_BIAS and option.key in values:
                try:
                    sampling[option.field] = token_bias(option.key, values[option.key])
                except BadOverride as exc:
                    raise JobError(f"job key {option.key!r}: {exc}") from None
        params = types["sampling"](
            **sampling,
            constraint=constraint_of(built["structured"]),
            reasoning=built["output"].reasoning_parser is not None,
        )
        # The schema lets NaN and inf through; hold the defaults to the check every row gets.
        problem = params.problem()
        if problem is not None:
            raise JobError(f"job sampling default: {problem}")
        return cls(sampling=params, **built)

    def with_keys(self, **keys: Any) -> JobSpec:
        """This job with some job keys changed, held to the schema and rules again."""
        return JobSpec.from_keys({**self.to_dict(), **keys})

    def value(self, key: str) -> Any:
        """A job key's value, as the spec holds it."""
        option = next(option for option in job_options() if option.key == key)
        return getattr(getattr(self, option.part), option.field)

    def to_dict(self) -> dict[str, Any]:
        """The job as job-file keys (None values left out, tuples as lists)."""
        out: dict[str, Any] = {}
        for option in job_options():
            value = self.value(option.key)
            if option.spec.kind is Kind.TOKEN_BIAS:
                value = token_bias_keys(value) or None
            if value is not None:
                out[option.key] = list(value) if isinstance(value, tuple) else value
        return out

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        """The schema of the job's output parts over this input: its columns, then the ones
        the job adds (with the reasoning and log-probability columns it asks for)."""
        output = self.output
        reasoning = output.reasoning_parser is not None
        return output_schema(input_schema, output.logprobs, output.prompt_logprobs, reasoning)

    def engine_config(self) -> EngineConfig:
        """What the engine is told: the engine part's options as they are, its models as paths
        and the log-probabilities the output asks for."""
        engine, output = self.engine, self.output
        return EngineConfig(
            target=Path(engine.target),
            draft=Path(engine.draft) if engine.draft is not None else None,
            logprobs=output.logprobs,
            prompt_logprobs=output.prompt_logprobs,
            **engine_options(engine),
        )

    def row_defaults(self) -> RowDefaults:
        """What each row gets where its cells say nothing."""
        return RowDefaults(
            sampling=self.sampling,
            chat_kwargs=self.input.chat_kwargs(),
            logprobs=self.output.logprobs is not None,
        )

    def default_params(self, row_index: int | None = None) -> SamplingParams:
        """The job's sampling defaults; with a row_index, seeded for that row."""
        if row_index is None:
            return self.sampling
        seed = row_seed(self.sampling.seed, row_index)
        return dataclasses.replace(self.sampling, seed=seed)


def _normalized(key: str, value: Any) -> Any:
    """A schema-valid key's value as the spec holds it: lists as tuples, numbers of number
    keys as floats, draft "none" as None, prompt_logprobs true/false as 0/None."""
    if key == "draft" and isinstance(value, str) and value.lower() == "none":
        return None
    if key == "prompt_logprobs" and isinstance(value, bool):
        return 0 if value else None
    if isinstance(value, list):
        return tuple(value)
    kind = next(option.spec.kind for option in job_options() if option.key == key)
    return float(value) if kind is Kind.FLOAT else value


def _check_rules(parts: Mapping[str, Any], thinking_budget: int | None) -> None:
    """The rules between keys that the schema cannot state, over the parts but sampling."""
    run: RunPart = parts["run"]
    structured: StructuredPart = parts["structured"]
    if run.shard is not None:
        parse_shard(run.shard)
    if thinking_budget is not None and parts["output"].logprobs is not None:
        raise JobError(THINKING_WITH_LOGPROBS)
    set_keys = [kind for kind in KINDS if getattr(structured, kind) is not None]
    if len(set_keys) > 1:
        raise JobError(f"job keys {set_keys[0]!r} and {set_keys[1]!r}: choose one")
    constraint = constraint_of(structured)  # one the grammar would not hold rows to, say
    problem = constraint.problem() if constraint is not None else None
    if constraint is not None and problem is not None:
        raise JobError(f"job key {constraint.kind!r}: {problem}")
    problem = chat_kwargs_problem(parts["input"].chat_template_kwargs or {})
    if problem is not None:
        raise JobError(f"job key 'chat_template_kwargs': {problem}")


def constraint_of(structured: StructuredPart) -> Constraint | None:
    """The job's structured output (a table's schema as JSON text), or None."""
    if structured.json_schema is not None:
        schema = structured.json_schema
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return Constraint("json_schema", text)
    if structured.regex is not None:
        return Constraint("regex", structured.regex)
    return Constraint("choice", structured.choice) if structured.choice is not None else None


def validate_job_dict(data: Mapping[str, Any]) -> None:
    """Raise JobError, naming the key, for the first way `data` breaks the job schema."""
    # Repeatable flags arrive as tuples; JSON Schema arrays are lists.
    data = {key: list(v) if isinstance(v, tuple) else v for key, v in data.items()}
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(job_schema()).iter_errors(data)
    )
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
    return resolve_paths(data, path.resolve().parent)


def load_job(job_file: Path | None = None, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """Defaults < job file < overrides (None values in overrides are unset flags); its paths
    checked (check_path) before anything opens them."""
    data = read_job_file(job_file) if job_file is not None else {}
    data.update({key: value for key, value in (overrides or {}).items() if value is not None})
    job = JobSpec.from_keys(data)
    for key in PATH_KEYS:
        value = job.value(key)
        if value is not None:
            check_path(key, value)
    return job
