"""The files users read the job file's JSON Schema (config/schema.py derives it from the options'
declarations) and the output Parquet schema from.

`python -m batchrun.config.schemas [DIR]` rewrites DIR/job.schema.json and DIR/output.schema.json
(DIR defaults to the repository's schemas/); a test checks the committed files are up to date.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.config.schema import job_schema
from batchrun.io.output.columns import (
    COMPLETION_LOGPROB_FIELDS,
    PROMPT_LOGPROBS_FIELD,
    PROMPT_TOP_LOGPROBS_FIELD,
    REASONING_FIELDS,
    TOP_LOGPROBS_FIELD,
    output_fields,
)


def _type_name(arrow_type: pa.DataType) -> str:
    if pa.types.is_list(arrow_type):
        return f"list<{_type_name(arrow_type.value_type)}>"
    if pa.types.is_struct(arrow_type):
        members = ", ".join(f"{f.name} {_type_name(f.type)}" for f in arrow_type)
        return f"struct<{members}>"
    if pa.types.is_floating(arrow_type):
        return f"float{arrow_type.bit_width}"  # Arrow says "float"/"double"; be explicit
    return str(arrow_type)


# When a column that not every job has is there.
_ONLY_WHEN = {
    **{field.name: "logprobs is set" for field in COMPLETION_LOGPROB_FIELDS},
    TOP_LOGPROBS_FIELD.name: "logprobs is above 0",
    PROMPT_LOGPROBS_FIELD.name: "prompt_logprobs is true or a number",
    PROMPT_TOP_LOGPROBS_FIELD.name: "prompt_logprobs is above 0",
    **{field.name: "reasoning_parser is set" for field in REASONING_FIELDS},
}


def output_schema_json() -> list[dict[str, Any]]:
    """The columns batchrun adds after the input's own columns, for users to read: every
    column a job can have, in order; `only_when` marks those that only some jobs have."""
    return [
        {
            "name": field.name,
            "type": _type_name(field.type),
            "nullable": field.nullable,
            **({"only_when": _ONLY_WHEN[field.name]} if field.name in _ONLY_WHEN else {}),
            "description": field.metadata[b"description"].decode(),
        }
        for field in output_fields(logprobs=1, prompt_logprobs=1, reasoning=True)
    ]


def schema_files() -> dict[str, str]:
    """File name -> exact text of each schema file."""
    return {
        "job.schema.json": json.dumps(job_schema(), indent=2) + "\n",
        "output.schema.json": json.dumps(output_schema_json(), indent=2) + "\n",
    }


def default_schema_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "schemas"


def write_schema_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in schema_files().items():
        (directory / name).write_text(text)


if __name__ == "__main__":
    write_schema_files(Path(sys.argv[1]) if len(sys.argv) > 1 else default_schema_dir())
