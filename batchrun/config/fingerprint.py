"""The job fingerprint: everything that changes a job's outputs, so that rows of two different
jobs are never mixed in one output directory.

Covered: each input file's identity (resolved path, size, mtime, a hash of its Parquet footer,
which holds its row counts and column statistics), the prompt column and its kind, the resolved
dtype, the target's and draft's files (names, sizes, mtimes), the sampling defaults (the
options declared with a fingerprint record, batchrun/sampling/params.py) and the
log-probability columns asked for, the chat template's arguments and an fp8 KV cache, which
rounds what attention reads (a job without them has no such key, as before they existed). Not
covered, as they do not change outputs: the id column, batch sizes, part sizes, the shard, the
schedule window. The context length comes from the target's config.json (no job key sets it),
so the model files cover it. A model directory may also be an output directory (of this job or
another): the files batchrun writes there (stats.json above all) are not model files, else a job
writing into its own target would be a different job on its next run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchrun.config.job import JobSpec
from batchrun.config.parts import EnginePart
from batchrun.errors import JobError
from batchrun.io.input.overrides import token_bias_keys
from batchrun.io.input.prompts import PromptColumn
from batchrun.io.input.reader import InputSource
from batchrun.io.output.fingerprint import FINGERPRINT_VERSION, input_file_identity, model_files
from batchrun.sampling.option import Kind, Record, declared
from batchrun.sampling.params import SamplingParams


def job_fingerprint(job: JobSpec, source: InputSource, prompt: PromptColumn) -> dict[str, Any]:
    """What makes two runs the same job, as JSON data (the form _progress/job.json holds)."""
    engine, output = job.engine, job.output
    fingerprint: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "input": {f.location: input_file_identity(f) for f in source.files},
        "prompt": {"column": prompt.name, "kind": prompt.kind.value},
        "dtype": resolved_dtype(engine),
        "target": model_files(Path(engine.target)),
        "draft": model_files(Path(engine.draft)) if engine.draft is not None else None,
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
    if output.reasoning_parser is not None:  # its columns; unset: none
        fingerprint["reasoning_parser"] = output.reasoning_parser
    if engine.kv_cache_dtype != "auto":  # fp8 K/V change outputs; auto: no key, as before
        fingerprint["kv_cache_dtype"] = engine.kv_cache_dtype
    data: dict[str, Any] = json.loads(json.dumps(fingerprint))  # tuples become lists, as on disk
    return data


def sampling_keys(params: SamplingParams) -> dict[str, Any]:
    """The job's sampling defaults as the fingerprint records them, in job-key form: options
    recorded always, those recorded when set only away from their default (so a job that
    does not set them keeps the fingerprint it had before they existed), and the constraint."""
    keys: dict[str, Any] = {}
    for item, spec in declared(type(params)):
        value = getattr(params, item.name)
        if spec.record is Record.ALWAYS or (
            spec.record is Record.WHEN_SET and value != item.default
        ):
            keys[item.name] = token_bias_keys(value) if spec.kind is Kind.TOKEN_BIAS else value
    if params.constraint is not None:  # likewise
        keys[params.constraint.kind] = params.constraint.value
    return keys


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
