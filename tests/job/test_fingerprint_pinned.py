"""The fingerprint keys come from the declarations (Record on each option's field): the
fingerprints of jobs as the code recorded them before that (hand-written keys, commit 48ad8c6)
are pinned here, byte for byte, so an output directory written then still resumes; and an
engine or output option declared with a record is a fingerprint key without more code."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from batchrun.config.fingerprint import job_fingerprint, recorded_keys
from batchrun.config.job import JobSpec
from batchrun.config.parts import EnginePart
from batchrun.io.input.prompts import PromptColumn, PromptKind
from batchrun.io.input.reader import InputSource
from batchrun.io.output.fingerprint import job_hash
from batchrun.sampling.option import Kind, Record, option

MTIME_NS = 1_700_000_000_000_000_000
FILES = {"config.json": [8, MTIME_NS], "model.safetensors": [5, MTIME_NS]}

EVERY_RECORDED_KEY: dict[str, Any] = {
    "draft": "DRAFT",
    "dtype": "bfloat16",
    "kv_cache_dtype": "fp8",
    "logprobs": 3,
    "prompt_logprobs": 2,
    "reasoning_parser": "qwen3",
    "chat_template_kwargs": {"a": 1},
    "thinking": False,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "seed": 7,
    "stop": ["x"],
    "stop_token_ids": [5],
    "n": 2,
    "ignore_eos": True,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.1,
    "min_tokens": 2,
    "logit_bias": {"3": -1.5},
    "min_p": 0.1,
    # Not recorded: they change no output.
    "max_batch_size": 8,
    "verify_width": 4,
    "cuda_graphs": False,
    "prefix_caching": False,
    "gpu_memory_fraction": 0.5,
    "max_constraint_bytes": 99,
    "grammar_compile_timeout": 3.0,
    "device": "cpu",
    "attention_backend": "torch",
}

# As 48ad8c6 wrote it to _progress/job.json (this key order, these values).
EVERY_RECORDED_KEY_FINGERPRINT: dict[str, Any] = {
    "version": 3,
    "input": {},
    "prompt": {"column": "prompt", "kind": "text"},
    "dtype": "bfloat16",
    "target": FILES,
    "draft": FILES,
    "sampling": {
        "max_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 7,
        "stop": ["x"],
        "stop_token_ids": [5],
        "n": 2,
        "ignore_eos": True,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "logit_bias": {"3": -1.5},
        "min_p": 0.1,
    },
    "logprobs": {"logprobs": 3, "prompt": True, "prompt_top": 2},
    "chat_template_kwargs": {"a": 1, "enable_thinking": False},
    "reasoning_parser": "qwen3",
    "kv_cache_dtype": "fp8",
}

# (job keys, the job hash 48ad8c6 gave them: what every part of such a job carries)
PINNED = [
    ({"device": "cpu"}, "f2003f570dc919ca5762d0d899da8fd3"),
    (EVERY_RECORDED_KEY, "6945195e4094e5dc179b8f0e48707bf8"),
    (
        {
            "regex": "[ab]+",
            "max_thinking_tokens": 5,
            "reasoning_parser": "auto",
            "prompt_logprobs": True,
            "device": "cpu",
        },
        "f4b5037d5cdced0140e5ca71cc5e0437",
    ),
    ({"choice": ["yes", "no"], "dtype": "float32"}, "ad5dfd33770469d3842f72cfc5abc84d"),
]


@pytest.fixture
def models(tmp_path: Path) -> Path:
    """A target and a draft directory whose files have fixed sizes and mtimes."""
    for name in ("target", "draft"):
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text('{"x": 1}')
        (model / "model.safetensors").write_bytes(b"12345")
        for path in model.iterdir():
            os.utime(path, ns=(MTIME_NS, MTIME_NS))
    return tmp_path


def fingerprint_of(keys: dict[str, Any], models: Path) -> dict[str, Any]:
    keys = {"input": "in", "output": "out", "target": str(models / "target"), **keys}
    if "draft" in keys:
        keys["draft"] = str(models / "draft")
    job = JobSpec.from_keys(keys)
    source = InputSource(files=(), schema=pa.schema([]))
    return job_fingerprint(job, source, PromptColumn(PromptKind.TEXT, "prompt"))


@pytest.mark.parametrize(("keys", "pinned"), PINNED)
def test_a_job_keeps_the_hash_it_had_before_the_declarations(
    keys: dict[str, Any], pinned: str, models: Path
) -> None:
    assert job_hash(fingerprint_of(keys, models)) == pinned


def test_job_json_is_written_as_before_the_declarations(models: Path) -> None:
    fingerprint = fingerprint_of(EVERY_RECORDED_KEY, models)
    written = json.dumps(fingerprint, indent=2)  # as io/output/directory.py writes job.json
    assert written == json.dumps(EVERY_RECORDED_KEY_FINGERPRINT, indent=2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtendedEngine(EnginePart):
    draft_temperature: float = option(
        0.0,
        kind=Kind.FLOAT,
        low=0,
        doc="The draft's sampling temperature.",
        record=Record.WHEN_SET,
    )
    draft_threads: int = option(1, kind=Kind.INT, low=1, doc="Threads of the draft.")


def test_a_declared_engine_option_is_a_fingerprint_key_by_its_record(models: Path) -> None:
    unset = ExtendedEngine(target=str(models / "target"), dtype="float32")
    assert recorded_keys(unset, Record.WHEN_SET) == {}
    changed = dataclasses.replace(unset, draft_temperature=0.5, draft_threads=4)
    assert recorded_keys(changed, Record.WHEN_SET) == {"draft_temperature": 0.5}
    always = recorded_keys(changed, Record.ALWAYS)
    assert always == {"dtype": "float32", "target": FILES, "draft": None}
    assert list(always) == ["dtype", "target", "draft"]
