"""Fingerprints of jobs (batchrun/config/fingerprint.py makes a job's): their digest, where two
differ, and the identity of the files they cover (input files, model directories)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from batchrun.errors import JobError
from batchrun.io.input.reader import InputFile, parquet_footer
from batchrun.io.parts import is_output_file

FINGERPRINT_VERSION = 3  # 3: the sample_index column, the n key
# Files of a model directory that shape its outputs: config, weights, tokenizer, chat template.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model", ".tiktoken")
_MISSING = object()  # a key one fingerprint has and the other lacks


def job_hash(fingerprint: dict[str, Any]) -> str:
    """A short digest of a fingerprint; every part file carries its job's."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def input_file_identity(file: InputFile) -> dict[str, Any]:
    try:
        size, mtime_ns = file.store.stat(file.path)
        footer_sha256 = (
            file.footer_sha256 or hashlib.sha256(parquet_footer(file.path, file.store)).hexdigest()
        )
    except OSError as exc:
        raise JobError(f"cannot read input file {file.shown!r}: {exc.strerror or exc}") from exc
    return {
        "size": size,
        "mtime_ns": mtime_ns,
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
