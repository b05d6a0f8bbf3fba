"""The job fingerprint: everything that changes a job's outputs, so that rows of two different
jobs are never mixed in one output directory.

Covered: each input file's identity (resolved path, size, mtime, a hash of its Parquet footer,
which holds its row counts and column statistics), the prompt column and its kind, the options
declared with a fingerprint record (batchrun/sampling/option.py's Record): the resolved dtype,
the target's and draft's files (names, sizes, mtimes), the sampling defaults, the reasoning
parser and an fp8 KV cache, which rounds what attention reads; and the log-probability columns
asked for and the chat template's arguments (a job without the last four has no such key, as
before they existed). Not
covered, as they do not change outputs: the id column, batch sizes, part sizes, the shard, the
schedule window. The context length comes from the target's config.json (no job key sets it),
so the model files cover it. A model directory may also be an output directory (of this job or
another): the files batchrun writes there (stats.json above all) are not model files, else a job
writing into its own target would be a different job on its next run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.config.job import JobSpec
from batchrun.config.parts import EnginePart
from batchrun.errors import JobError
from batchrun.io.input.overrides import token_bias_keys
from batchrun.io.input.prompts import PromptColumn
from batchrun.io.input.reader import InputSource
from batchrun.io.output.fingerprint import FINGERPRINT_VERSION, input_file_identity, model_files
from batchrun.sampling.option import Kind, Option, Record, declared, key_of
from batchrun.sampling.params import SamplingParams


def job_fingerprint(job: JobSpec, source: InputSource, prompt: PromptColumn) -> dict[str, Any]:
    """What makes two runs the same job, as JSON data (the form _progress/job.json holds)."""
    engine, output = job.engine, job.output
    fingerprint: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "input": {f.location: input_file_identity(f) for f in source.files},
        "prompt": {"column": prompt.name, "kind": prompt.kind.value},
        **recorded_keys(engine, Record.ALWAYS),
        "sampling": sampling_keys(job.sampling),
    }
    top_k = output.prompt_logprobs
    if output.logprobs is not None or top_k is not None:  # columns of their own; unset: none
        fingerprint["logprobs"] = {"logprobs": output.logprobs, "prompt": top_k is not None}
        if top_k:  # K; 0: no key, as before K existed
            fingerprint["logprobs"]["prompt_top"] = top_k
    chat_kwargs = job.input.chat_kwargs()
    if chat_kwargs:  # the chat template's arguments; unset: no key, as before they existed
        fingerprint["chat_template_kwargs"] = chat_kwargs
    fingerprint |= recorded_keys(output, Record.WHEN_SET) | recorded_keys(engine, Record.WHEN_SET)
    data: dict[str, Any] = json.loads(json.dumps(fingerprint))  # tuples become lists, as on disk
    return data


def recorded_keys(part: Any, record: Record) -> dict[str, Any]:
    """The keys of a job part (not sampling) that its declarations record so, by job key: each
    value as _RECORDED_AS writes it, else as it is. Those of _RECORDED_AS come first, in its
    order (job.json's since before the declarations), then the others in field order."""
    keys: dict[str, Any] = {}
    first = {key: place for place, key in enumerate(_RECORDED_AS)}
    fields = sorted(declared(type(part)), key=lambda pair: first.get(key_of(*pair), len(first)))
    for item, spec in fields:
        value = getattr(part, item.name)
        if spec.record is record and _recorded(spec, value, item.default):
            key = key_of(item, spec)
            keys[key] = _RECORDED_AS[key](part) if key in _RECORDED_AS else value
    return keys


def sampling_keys(params: SamplingParams) -> dict[str, Any]:
    """The job's sampling defaults as the fingerprint records them, in job-key form: options
    recorded always, those recorded when set only away from their default (so a job that
    does not set them keeps the fingerprint it had before they existed), and the constraint."""
    keys: dict[str, Any] = {}
    for item, spec in declared(type(params)):
        value = getattr(params, item.name)
        if _recorded(spec, value, item.default):
            keys[item.name] = token_bias_keys(value) if spec.kind is Kind.TOKEN_BIAS else value
    if params.constraint is not None:  # likewise
        keys[params.constraint.kind] = params.constraint.value
    return keys


def _recorded(spec: Option, value: Any, default: Any) -> bool:
    """Whether the fingerprint holds an option of this value: one recorded always, or one
    recorded when set, away from its default (a job that does not set it keeps the
    fingerprint it had before the option existed)."""
    return spec.record is Record.ALWAYS or (spec.record is Record.WHEN_SET and value != default)


def resolved_dtype(engine: EnginePart) -> str:
    """The dtype the engine will use, known from config.json and the device; else "auto"."""
    if engine.dtype != "auto":
        return engine.dtype
    from batchrun.device import resolve_device
    from batchrun.models.loader import read_config, resolve_dtype

    try:
        config = read_config(Path(engine.target))
        device = resolve_device(engine.device)
    except JobError:
        return "auto"  # the start-up checks report what is wrong
    return str(resolve_dtype("auto", config, device)).removeprefix("torch.")


def _model_files(model: str | None) -> dict[str, list[int]] | None:
    return model_files(Path(model)) if model is not None else None


# How the fingerprint writes a recorded key whose value is not what changes outputs: the dtype
# the engine will resolve, the files of the model directories.
_RECORDED_AS: dict[str, Callable[[EnginePart], Any]] = {
    "dtype": resolved_dtype,
    "target": lambda engine: _model_files(engine.target),
    "draft": lambda engine: _model_files(engine.draft),
}
