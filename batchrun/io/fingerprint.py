"""The job fingerprint: everything that changes a job's outputs, so that rows of two different
jobs are never mixed in one output directory.

Covered: each input file's identity (resolved path, size, mtime, a hash of its Parquet footer,
which holds its row counts and column statistics), the prompt column and its kind, the resolved
dtype, the target's and draft's files (names, sizes, mtimes), the sampling defaults and the
log-probability columns asked for, the chat template's arguments and an fp8 KV cache, which
rounds what attention reads (a job without them has no such key, as before they existed). Not
covered, as they do not change outputs: the id column, batch sizes, part sizes, the shard, the
schedule window. The context length comes from
the target's config.json (no job key sets it), so the model files cover it. A model directory
may also be an output directory (of this job or another): the files batchrun writes there
(stats.json above all) are not model files, else a job writing into its own target would be a
different job on its next run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchrun.errors import JobError
from batchrun.io.parts import is_output_file
from batchrun.io.reader import InputFile, InputSource, parquet_footer

if TYPE_CHECKING:
    from batchrun.io.prompts import PromptColumn
    from batchrun.job import JobSpec

FINGERPRINT_VERSION = 3  # 3: the sample_index column, the n key
# Files of a model directory that shape its outputs: config, weights, tokenizer, chat template.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model", ".tiktoken")
_MISSING = object()  # a key one fingerprint has and the other lacks


# Sampling controls recorded only when set, so that a job without them keeps its fingerprint.
_CONTROLS_UNSET: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logit_bias": (),
    "min_p": 0.0,
}


def job_fingerprint(job: JobSpec, source: InputSource, prompt: PromptColumn) -> dict[str, Any]:
    """What makes two runs the same job, as JSON data (the form _progress/job.json holds)."""
    fingerprint: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "input": {str(f.path.resolve()): input_file_identity(f) for f in source.files},
        "prompt": {"column": prompt.name, "kind": prompt.kind.value},
        "dtype": resolved_dtype(job),
        "target": model_files(Path(job.target)),
        "draft": model_files(Path(job.draft)) if job.draft is not None else None,
        "sampling": {
            "max_tokens": job.max_tokens,
            "temperature": job.temperature,
            "top_p": job.top_p,
            "top_k": job.top_k,
            "seed": job.seed,
            "stop": list(job.stop),
            "stop_token_ids": list(job.stop_token_ids),
            "n": job.n,
        },
    }
    if job.ignore_eos:  # unset: no key, as before it existed
        fingerprint["sampling"]["ignore_eos"] = True
    if job.max_thinking_tokens is not None:  # likewise
        fingerprint["sampling"]["max_thinking_tokens"] = job.max_thinking_tokens
    controls = job.default_params()
    for name, unset in _CONTROLS_UNSET.items():  # likewise
        if getattr(controls, name) != unset:
            fingerprint["sampling"][name] = getattr(job, name)
    constraint = job.constraint()
    if constraint is not None:  # likewise
        fingerprint["sampling"][constraint.kind] = constraint.value
    top_k = job.prompt_logprobs
    if job.logprobs is not None or top_k is not None:  # columns of their own; unset: none
        fingerprint["logprobs"] = {"logprobs": job.logprobs, "prompt": top_k is not None}
        if top_k:  # K; 0: no key, as before K existed
            fingerprint["logprobs"]["prompt_top"] = top_k
    if job.chat_kwargs():  # the chat template's arguments; unset: no key, as before they existed
        fingerprint["chat_template_kwargs"] = job.chat_kwargs()
    if job.reasoning_parser is not None:  # its columns; unset: none
        fingerprint["reasoning_parser"] = job.reasoning_parser
    if job.kv_cache_dtype != "auto":  # fp8 K/V change outputs; auto: no key, as before
        fingerprint["kv_cache_dtype"] = job.kv_cache_dtype
    data: dict[str, Any] = json.loads(json.dumps(fingerprint))  # tuples become lists, as on disk
    return data


def job_hash(fingerprint: dict[str, Any]) -> str:
    """A short digest of a fingerprint; every part file carries its job's."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def input_file_identity(file: InputFile) -> dict[str, Any]:
    try:
        stat = file.path.stat()
        footer_sha256 = file.footer_sha256 or hashlib.sha256(parquet_footer(file.path)).hexdigest()
    except OSError as exc:
        raise JobError(f"cannot read input file {str(file.path)!r}: {exc.strerror or exc}") from exc
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "rows": file.num_rows,
        "footer_sha256": footer_sha256,
    }


def model_files(model_dir: Path) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of the files of a model directory that shape outputs."""
    files: dict[str, list[int]] = {}
    for path in sorted(model_dir.iterdir()):
        if path.name.startswith(".") or path.suffix not in MODEL_FILE_SUFFIXES:
            continue
        if is_output_file(path.name):  # batchrun's own output, when this is an output directory
            continue
        if path.is_file():
            stat = path.stat()
            files[path.name] = [stat.st_size, stat.st_mtime_ns]
    return files


def resolved_dtype(job: JobSpec) -> str:
    """The dtype the engine will use, known from config.json and the device; else "auto"."""
    if job.dtype != "auto":
        return job.dtype
    from batchrun.device import resolve_device
    from batchrun.models.loader import read_config, resolve_dtype

    try:
        config = read_config(Path(job.target))
        device = resolve_device(job.device)
    except JobError:
        return "auto"  # the start-up checks report what is wrong
    return str(resolve_dtype("auto", config, device)).removeprefix("torch.")


def first_difference(recorded: Any, current: Any, where: str = "") -> str | None:
    """Where two fingerprints first differ, as "sampling.seed" or "target['config.json']"."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        keys = [*current, *(key for key in recorded if key not in current)]
        for key in keys:
            place = _join(where, key)
            found = first_difference(recorded.get(key, _MISSING), current.get(key, _MISSING), place)
            if found is not None:
                return found
        return None
    return None if recorded == current else (where or "job")


def _join(where: str, key: str) -> str:
    if not where:
        return key
    return f"{where}.{key}" if key.isidentifier() else f"{where}[{key!r}]"
