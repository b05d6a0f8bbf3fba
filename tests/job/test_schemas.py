"""The committed schema files are what the code generates, and agree with JobSpec and the parts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pytest

from batchrun.config.job import JobSpec, validate_job_dict
from batchrun.config.options import job_options
from batchrun.config.schema import job_schema
from batchrun.config.schemas import default_schema_dir, schema_files, write_schema_files
from batchrun.engine.options import MAX_BATCH_SIZE, MAX_BATCHED_TOKENS
from batchrun.errors import JobError
from batchrun.io.output.columns import OUTPUT_FIELDS, OutputRow, output_fields, output_schema
from batchrun.sampling.params import SEED_END, SEED_MIN, SamplingParams


def test_committed_schema_files_are_up_to_date() -> None:
    for name, text in schema_files().items():
        committed = (default_schema_dir() / name).read_text()
        assert committed == text, f"schemas/{name} is stale: run python -m batchrun.config.schemas"


def test_write_schema_files(tmp_path: Path) -> None:
    write_schema_files(tmp_path)
    for name, text in schema_files().items():
        assert (tmp_path / name).read_text() == text


def test_job_schema_is_valid_and_matches_jobspec() -> None:
    schema = job_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["properties"]) == {option.key for option in job_options()}
    assert schema["additionalProperties"] is False
    assert all(prop.get("description") for prop in schema["properties"].values())


def test_schema_defaults_are_jobspec_defaults() -> None:
    job = JobSpec.from_keys({"input": "in", "output": "out", "target": "model"})
    for name, prop in job_schema()["properties"].items():
        if "default" in prop:
            expected = job.value(name)
            assert prop["default"] == (list(expected) if isinstance(expected, tuple) else expected)


def test_output_schema_file_lists_the_output_columns_in_order() -> None:
    listed = json.loads(schema_files()["output.schema.json"])
    assert [c["name"] for c in listed] == [
        "row_index",
        "sample_index",
        "completion",
        "completion_token_ids",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "spec_rounds",
        "spec_accept_hist",
        "spec_capped_hist",
        "acceptance_length",
        "reasoning",
        "reasoning_tokens",
        "completion_logprobs",
        "completion_logprob_sum",
        "top_logprobs",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "error",
    ]
    assert [c["type"] for c in listed][:4] == ["int64", "int32", "string", "list<int32>"]
    types = {c["name"]: c["type"] for c in listed}
    assert types["acceptance_length"] == "float32"
    assert types["top_logprobs"] == "list<list<struct<token_id int32, logprob float32>>>"
    assert types["prompt_top_logprobs"] == types["top_logprobs"]
    assert all(c["description"] for c in listed)
    only_some_jobs = {c["name"] for c in listed if "only_when" in c}
    assert only_some_jobs == {c["name"] for c in listed} - {f.name for f in OUTPUT_FIELDS}
    every_column = output_fields(logprobs=1, prompt_logprobs=1, reasoning=True)
    assert {f.name for f in dataclasses.fields(OutputRow)} == {f.name for f in every_column}


def test_output_schema_keeps_input_columns_first() -> None:
    input_schema = pa.schema([("id", pa.string()), ("prompt", pa.large_string())])
    schema = output_schema(input_schema.with_metadata({"pandas": "{}"}))
    assert schema.names[:2] == ["id", "prompt"]
    assert schema.field("prompt").type == pa.large_string()
    assert schema.metadata is None
    assert schema.field("error").metadata == {
        b"description": OUTPUT_FIELDS[-1].metadata[b"description"]
    }


def test_the_schema_s_seeds_are_the_engine_s() -> None:
    """A seed is any integer in [-2^63, 2^64): the schema, the flag, the job key and a row's
    cell (SamplingParams.problem) agree at both ends."""
    seed = job_schema()["properties"]["seed"]
    assert (seed["minimum"], seed["maximum"]) == (SEED_MIN, SEED_END - 1)
    job = {"input": "i", "output": "o", "target": "t"}
    for value in (SEED_MIN, -1, 0, SEED_END - 1):
        validate_job_dict({**job, "seed": value})
        assert SamplingParams(seed=value).problem() is None
    for value in (SEED_MIN - 1, SEED_END):
        with pytest.raises(JobError, match="job key 'seed'"):
            validate_job_dict({**job, "seed": value})
        assert (SamplingParams(seed=value).problem() or "").startswith("seed must be")


def test_batch_limits_have_sane_maxima() -> None:
    properties = job_schema()["properties"]
    assert properties["max_batch_size"]["maximum"] == MAX_BATCH_SIZE == 65536
    assert properties["max_batched_tokens"]["maximum"] == MAX_BATCHED_TOKENS == 1 << 24
    job = {"input": "i", "output": "o", "target": "t"}
    validate_job_dict({**job, "max_batch_size": MAX_BATCH_SIZE})
    with pytest.raises(JobError, match="job key 'max_batched_tokens': 1000000000 is greater"):
        validate_job_dict({**job, "max_batched_tokens": 10**9})
