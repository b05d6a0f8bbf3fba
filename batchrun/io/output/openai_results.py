"""An output directory as an OpenAI Batch output file: one JSON line per input row (request).

A row that ran gives `response` {status_code 200, body} with a chat.completion body (a request to
/v1/chat/completions) or a text_completion body (/v1/completions): one choice per sample
(sample_index), and usage summed over them; a row that failed gives `response` null and `error`
{code "invalid_request", message: the row's error}. The endpoint is the row's `url` column (kept
from a batch file); rows of a Parquet input are chat rows when it had a `messages` column.

The output may be local or in object storage (s3://, gs://), read through its store as `batchrun
stats` reads it; the file written is local. The parts are read batch by batch, and only the
columns this needs: memory stays bounded by one record batch whatever the output's size. Lines
come in the order the parts hold the rows (OpenAI does not promise an order either: match
results to requests by custom_id).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import JobError
from batchrun.io.input.openai_batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    ID_COLUMN,
    MESSAGES_COLUMN,
    MODEL_COLUMN,
    URL_COLUMN,
)
from batchrun.io.output.directory import STATS_FILE, OutputDir
from batchrun.io.parts import write_atomically
from batchrun.io.store import ObjectLocation, Store, storage_reason

ERROR_CODE = "invalid_request"  # every error row is one its request caused
_READ_ROWS = 1024
_NEEDED = [
    "row_index",
    "sample_index",
    "completion",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
]
_OPTIONAL = [ID_COLUMN, URL_COLUMN, MODEL_COLUMN, "reasoning"]


@dataclass(frozen=True)
class Written:
    """What an export wrote: result lines, those of them errors, and whether the job is done
    (every input row has its line; else the rows still running are left out)."""

    results: int
    errors: int
    complete: bool


def write_results(output_dir: str, destination: Path) -> Written:
    """Write the OpenAI Batch output file of output_dir's committed rows (a local directory or an
    object-store URI, read as `batchrun stats` reads it) to destination, a local file (written
    atomically: a reader never sees half a file). JobError when there is nothing to export."""
    out = OutputDir.at(output_dir)
    out.use_recorded_job()
    try:
        parts = out.committed_parts()
        if not parts:
            raise JobError(f"no part files of a batchrun job in {out.shown!r}")
        model = _job_model(out)
        counts = [0, 0]

        def write(temp: Path) -> None:
            with temp.open("w", encoding="utf-8") as file:
                counts[:] = _write_lines(file, out.store, parts, model)

        try:
            write_atomically(destination, write)
        except OSError as exc:
            raise JobError(f"cannot write {str(destination)!r}: {exc.strerror or exc}") from exc
        return Written(counts[0], counts[1], out.complete())
    except OSError as exc:  # the store's, one line already
        raise JobError(f"cannot read {out.shown!r}: {exc}") from exc


def _job_model(out: OutputDir) -> str:
    """The name results give a request without its own model: the target directory's."""
    try:
        target = json.loads(out.store.read_text(out.path / STATS_FILE)).get("target")
    except (OSError, ValueError, AttributeError):
        target = None
    return Path(target).name if isinstance(target, str) and target else "batchrun"


def _write_lines(file: TextIO, store: Store, parts: Sequence[PurePath], model: str) -> list[int]:
    seen = bytearray()  # 1 at each row_index written (parts may repeat a row: the first counts)
    results = errors = 0
    for part in parts:
        created = store.stat(part)[1] // 1_000_000_000
        for samples in _row_samples(store, part):
            row_index = samples[0]["row_index"]
            if row_index < len(seen) and seen[row_index]:
                continue
            seen.extend(bytes(max(0, row_index + 1 - len(seen))))
            seen[row_index] = 1
            line = result_line(samples, model, created)
            errors += line["error"] is not None
            results += 1
            file.write(json.dumps(line, ensure_ascii=False) + "\n")
    return [results, errors]


def _row_samples(store: Store, part: PurePath) -> Iterator[list[dict[str, Any]]]:
    """Each row's output rows (its samples, which a part holds together), as dicts."""
    shown = store.shown(part)
    try:
        reader = pq.ParquetFile(store.open_input(part))
        names = reader.schema_arrow.names
        missing = [name for name in _NEEDED if name not in names]
        if missing:
            raise JobError(f"{shown!r} is not a batchrun part: it has no {missing[0]!r}")
        columns = _NEEDED + [name for name in _OPTIONAL if name in names]
        chat = MESSAGES_COLUMN in names
        pending: list[dict[str, Any]] = []
        for batch in reader.iter_batches(batch_size=_READ_ROWS, columns=columns):
            for row in batch.to_pylist():
                row.setdefault(URL_COLUMN, None)
                row[URL_COLUMN] = row[URL_COLUMN] or (CHAT_URL if chat else COMPLETIONS_URL)
                if pending and row["row_index"] != pending[0]["row_index"]:
                    yield pending
                    pending = []
                pending.append(row)
        if pending:
            yield pending
    except (OSError, pa.ArrowException) as exc:
        why = exc if store.local else storage_reason(exc, ObjectLocation.parse(shown))
        raise JobError(f"cannot read {shown!r}: {why}") from exc


def result_line(samples: Sequence[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
    """One input row's OpenAI Batch output line, from its output rows (one per sample)."""
    first = samples[0]
    row_index = first["row_index"]
    custom_id = first.get(ID_COLUMN, f"row-{row_index}")
    if custom_id is not None and not isinstance(custom_id, str):
        custom_id = str(custom_id)  # the format's custom_id is a string (a Parquet id: any type)
    line: dict[str, Any] = {"id": f"batchrun-{row_index}", "custom_id": custom_id}
    if all(sample["finish_reason"] == "error" for sample in samples):
        return {**line, "response": None, "error": {"code": ERROR_CODE, "message": first["error"]}}
    chat = first[URL_COLUMN] == CHAT_URL
    ordered = sorted(samples, key=lambda sample: sample["sample_index"])
    completion_tokens = sum(sample["completion_tokens"] for sample in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{row_index}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": first.get(MODEL_COLUMN) or model,
        "choices": [_choice(sample, chat) for sample in ordered],
        "usage": {
            "prompt_tokens": first["prompt_tokens"],
            "completion_tokens": completion_tokens,
            "total_tokens": first["prompt_tokens"] + completion_tokens,
        },
    }
    response = {"status_code": 200, "request_id": line["id"], "body": body}
    return {**line, "response": response, "error": None}


def _choice(sample: dict[str, Any], chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": sample["sample_index"]}
    if chat:
        message = {"role": "assistant", "content": sample["completion"]}
        if sample.get("reasoning") is not None:  # vLLM's name for the think block
            message["reasoning_content"] = sample["reasoning"]
        choice["message"] = message
    else:
        choice["text"] = sample["completion"]
    return {**choice, "logprobs": None, "finish_reason": sample["finish_reason"]}
