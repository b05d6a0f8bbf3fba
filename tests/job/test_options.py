"""One declaration per option: an option added in this test (a SamplingParams field with its
declaration) is found in the flags, the job schema, the override columns and the fingerprint;
and a job that sets nothing new keeps the fingerprint it had before the declarations."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pyarrow as pa
import pytest

from batchrun.cli.options import job_flags
from batchrun.config import options
from batchrun.config.fingerprint import job_fingerprint, sampling_keys
from batchrun.config.job import JobSpec
from batchrun.config.schema import job_schema
from batchrun.errors import JobError
from batchrun.io.input.overrides import BadOverride, convert_cell, override_kinds
from batchrun.io.input.prompts import PromptColumn, PromptKind
from batchrun.io.input.reader import InputSource
from batchrun.sampling.option import Kind, Record, option
from batchrun.sampling.params import SamplingParams

TYPICAL_P = option(
    1.0,
    kind=Kind.FLOAT,
    low=0,
    low_open=True,
    high=1,
    doc="Keep the locally typical tokens whose mass reaches typical_p; 1 is off.",
    help="Locally typical sampling mass; 1 = off.",
    column=True,
    record=Record.WHEN_SET,
)
ExtendedParams = dataclasses.make_dataclass(
    "ExtendedParams", [("typical_p", float, TYPICAL_P)], bases=(SamplingParams,), frozen=True
)


@pytest.fixture
def extended(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The job's sampling part declared by ExtendedParams instead of SamplingParams."""
    parts = tuple((n, ExtendedParams if c is SamplingParams else c) for n, c in options.PARTS)
    monkeypatch.setattr(options, "PARTS", parts)
    options.job_options.cache_clear()
    yield
    options.job_options.cache_clear()


@pytest.mark.usefixtures("extended")
def test_a_declared_option_is_a_flag_with_its_help_type_and_default() -> None:
    command = job_flags(click.command()(lambda **_: None))
    (flag,) = [p for p in command.params if p.name == "typical_p"]
    assert isinstance(flag, click.Option) and flag.opts == ["--typical-p"]
    assert flag.type is click.FLOAT
    assert flag.help == "Locally typical sampling mass; 1 = off.  [default: 1.0]"


@pytest.mark.usefixtures("extended")
def test_a_declared_option_is_a_job_key_with_its_range() -> None:
    assert job_schema()["properties"]["typical_p"] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 1,
        "default": 1.0,
        "description": "Keep the locally typical tokens whose mass reaches typical_p; 1 is off.",
    }
    keys = {"input": "in", "output": "out", "target": "model"}
    with pytest.raises(JobError, match="job key 'typical_p'"):
        JobSpec.from_keys({**keys, "typical_p": 1.5})
    job = JobSpec.from_keys({**keys, "typical_p": 0.5})
    assert job.sampling.typical_p == 0.5 and job.to_dict()["typical_p"] == 0.5


def test_a_declared_option_is_an_override_column_with_its_conversion() -> None:
    kinds = override_kinds(ExtendedParams)
    assert kinds["typical_p"] is Kind.FLOAT
    assert list(kinds)[:-1] == list(override_kinds())  # the others, in their order
    assert convert_cell(kinds["typical_p"], "typical_p", 1) == 1.0
    with pytest.raises(BadOverride, match="typical_p must be a number"):
        convert_cell(kinds["typical_p"], "typical_p", "high")


def test_a_declared_option_is_a_fingerprint_key_only_when_set() -> None:
    unset = sampling_keys(ExtendedParams())
    assert "typical_p" not in unset and unset == sampling_keys(SamplingParams())
    assert sampling_keys(ExtendedParams(typical_p=0.5))["typical_p"] == 0.5


def test_every_sampling_option_is_declared_once_with_its_places() -> None:
    """Each SamplingParams field but the derived ones is a declared job key and override
    column; the flags are every declared key with a help text."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"constraint", "reasoning"}
    assert fields == set(override_kinds())
    assert fields <= set(job_schema()["properties"])
    flags = {p.name for p in job_flags(click.command()(lambda **_: None)).params}
    assert fields - flags == {"logit_bias"}  # a job key and a column, no flag


# Fingerprints of jobs as the code before the declarations recorded them (less the input and
# model files, which the declarations do not touch).
RECORDED = [
    (
        {},
        {
            "dtype": "auto",
            "sampling": {
                "max_tokens": 256,
                "n": 1,
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
    (
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "seed": 7,
            "stop": ["\n"],
            "stop_token_ids": [3],
            "n": 2,
            "max_tokens": 9,
        },
        {
            "dtype": "auto",
            "sampling": {
                "max_tokens": 9,
                "n": 2,
                "seed": 7,
                "stop": ["\n"],
                "stop_token_ids": [3],
                "temperature": 0.7,
                "top_k": 20,
                "top_p": 0.9,
            },
        },
    ),
    (
        {"ignore_eos": True, "max_thinking_tokens": 5, "reasoning_parser": "qwen3"},
        {
            "dtype": "auto",
            "reasoning_parser": "qwen3",
            "sampling": {
                "ignore_eos": True,
                "max_thinking_tokens": 5,
                "max_tokens": 256,
                "n": 1,
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
    (
        {
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "logit_bias": {"12": -100, "3": 2.5},
            "min_p": 0.1,
        },
        {
            "dtype": "auto",
            "sampling": {
                "frequency_penalty": -1.0,
                "logit_bias": {"12": -100, "3": 2.5},
                "max_tokens": 256,
                "min_p": 0.1,
                "min_tokens": 2,
                "n": 1,
                "presence_penalty": 0.5,
                "repetition_penalty": 1.2,
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
    (
        {"json_schema": {"type": "object"}, "logprobs": 2, "prompt_logprobs": True},
        {
            "dtype": "auto",
            "logprobs": {"logprobs": 2, "prompt": True},
            "sampling": {
                "json_schema": '{"type": "object"}',
                "max_tokens": 256,
                "n": 1,
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
    (
        {
            "regex": "[a-z]+",
            "prompt_logprobs": 3,
            "chat_template_kwargs": {"enable_thinking": False},
            "thinking": True,
        },
        {
            "chat_template_kwargs": {"enable_thinking": True},
            "dtype": "auto",
            "logprobs": {"logprobs": None, "prompt": True, "prompt_top": 3},
            "sampling": {
                "max_tokens": 256,
                "n": 1,
                "regex": "[a-z]+",
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
    (
        {"choice": ["yes", "no"], "kv_cache_dtype": "fp8", "dtype": "float32"},
        {
            "dtype": "float32",
            "kv_cache_dtype": "fp8",
            "sampling": {
                "choice": ["yes", "no"],
                "max_tokens": 256,
                "n": 1,
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
    (
        {"logit_bias": {}, "presence_penalty": 0, "min_p": 0},
        {
            "dtype": "auto",
            "sampling": {
                "max_tokens": 256,
                "n": 1,
                "seed": 0,
                "stop": [],
                "stop_token_ids": [],
                "temperature": 0.0,
                "top_k": 0,
                "top_p": 1.0,
            },
        },
    ),
]


@pytest.mark.parametrize(("keys", "recorded"), RECORDED)
def test_an_unchanged_job_keeps_its_fingerprint(
    keys: dict[str, Any], recorded: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "model").mkdir()
    job = JobSpec.from_keys(
        {"input": "in", "output": "out", "target": str(tmp_path / "model"), **keys}
    )
    source = InputSource(files=(), schema=pa.schema([]))
    fingerprint = job_fingerprint(job, source, PromptColumn(PromptKind.TEXT, "prompt"))
    assert fingerprint["target"] == {} and fingerprint["draft"] is None
    rest = {
        k: v
        for k, v in fingerprint.items()
        if k not in ("input", "target", "draft", "prompt", "version")
    }
    assert rest == recorded


def test_a_declared_option_is_held_to_its_range_by_problem() -> None:
    assert ExtendedParams(typical_p=0.5).problem() is None
    assert ExtendedParams(typical_p=1.5).problem() == "typical_p must be in (0, 1], got 1.5"
    assert ExtendedParams(typical_p=1e-46).problem() == (
        "typical_p must be in (0, 1], got 1e-46 (0 in float32)"
    )
