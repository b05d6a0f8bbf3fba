"""The job file's JSON Schema and the output Parquet schema, and the files users read them from.

`python -m batchrun.schemas [DIR]` rewrites DIR/job.schema.json and DIR/output.schema.json
(DIR defaults to the repository's schemas/); a test checks the committed files are up to date.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.engine.request import MAX_SAMPLES, SEED_END, SEED_MIN
from batchrun.io.output_schema import (
    COMPLETION_LOGPROB_FIELDS,
    PROMPT_LOGPROBS_FIELD,
    PROMPT_TOP_LOGPROBS_FIELD,
    REASONING_FIELDS,
    TOP_LOGPROBS_FIELD,
    output_fields,
)
from batchrun.sampling.grammar_compile import COMPILE_SECONDS, MAX_CONSTRAINT_BYTES

_PATH_NOTE = "Relative paths in a job file resolve against the job file's directory."

# Sanity maxima of the batch limits, so that an absurd number is refused before any model file
# is read; what a device can really hold is checked at start-up, from the model's shapes
# (engine/memory.py, check_batch_memory). 65,536 requests in flight: each holds at least a page
# of K/V and samples a row of float32 logits, which at Qwen3's vocabulary of 151,936 are 40 GB
# for 65,536 rows alone, and vLLM's default is 256 (its largest CUDA graph 512). 2^24 tokens per
# forward: 400 full 40,960-token contexts; at Qwen3-8B's hidden size (4,096, bfloat16) the
# residual stream of such a forward alone is 128 GiB.
MAX_BATCH_SIZE = 1 << 16
MAX_BATCHED_TOKENS = 1 << 24
# Most probable tokens listed per position (logprobs = k, prompt_logprobs = K), vLLM's default.
MAX_LOGPROBS = 20


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "description": description}


def _integer(description: str, default: int, minimum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "default": default, "description": description}


def _choice(description: str, choices: list[str]) -> dict[str, Any]:
    return {"type": "string", "enum": choices, "default": "auto", "description": description}


def _number(description: str, default: float, minimum: float, maximum: float) -> dict[str, Any]:
    return {
        "type": "number",
        "minimum": minimum,
        "maximum": maximum,
        "default": default,
        "description": description,
    }


def _flag(description: str, default: bool) -> dict[str, Any]:
    return {"type": "boolean", "default": default, "description": description}


def job_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of a job: the keys of a job file, which are also the CLI flags."""
    properties: dict[str, Any] = {
        "input": _string(
            f"Parquet file, directory of Parquet files, or glob; files are read sorted by path. "
            f"{_PATH_NOTE}"
        ),
        "output": _string(f"Output directory for part files, progress and stats. {_PATH_NOTE}"),
        "target": _string(f"Target model directory (Hugging Face layout). {_PATH_NOTE}"),
        "draft": _string(
            'DFlash draft model directory, or "none" for plain decoding (the default). '
            + _PATH_NOTE
        ),
        "prompt_column": _string("Text prompt column (default: `prompt` if it exists)."),
        "messages_column": _string(
            "Chat column, list<struct<role, content>>, rendered with the target's chat template "
            "(default: `messages` if it exists)."
        ),
        "token_ids_column": _string(
            "Column of prompt token ids, list<int> (default: `prompt_token_ids` if it exists)."
        ),
        "id_column": _string(
            "Column that names rows in logs (row_index serves when unset; need not be unique)."
        ),
        "max_tokens": _integer("Default maximum number of generated tokens per row.", 256, 1),
        "temperature": {
            "type": "number",
            "minimum": 0,
            "default": 0.0,
            "description": "Default sampling temperature; 0 is greedy and reproducible.",
        },
        "top_p": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": 1.0,
            "description": "Default nucleus sampling mass; 1 keeps every token.",
        },
        "top_k": _integer("Default top-k cutoff; 0 turns it off.", 0, 0),
        "seed": _integer(
            "Job seed, any integer in [-2^63, 2^64), used modulo 2^64 (so -1 and 2^64-1 sample "
            "alike); a row without a `seed` cell gets a distinct seed derived from it and its "
            "row_index (and each of its n samples one of its own).",
            0,
            SEED_MIN,
        )
        | {"maximum": SEED_END - 1},
        "stop": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "default": [],
            "description": "Default stop strings; the completion is cut before the first one.",
        },
        "stop_token_ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0},
            "default": [],
            "description": "Default token ids that end generation (in addition to EOS).",
        },
        "n": _integer(
            f"Default samples per row (at most {MAX_SAMPLES}): n output rows with sample_index "
            "0 .. n-1, each with its own seed, sharing the prompt's K/V.",
            1,
            1,
        )
        | {"maximum": MAX_SAMPLES},
        "chat_template_kwargs": {
            "type": "object",
            "description": "Arguments to the chat template of messages rows, e.g. "
            "{enable_thinking = false} for Qwen3; a row's chat_template_kwargs column (a JSON "
            "object or a struct) adds to them.",
        },
        "thinking": {
            "type": "boolean",
            "description": "Shorthand for chat_template_kwargs.enable_thinking (Qwen3's switch); "
            "unset: the template's default.",
        },
        "reasoning_parser": {
            "type": "string",
            "enum": ["qwen3", "auto"],
            "description": "Split each completion's think block from its answer: columns "
            "reasoning and reasoning_tokens, completion the answer only. auto: qwen3 where the "
            "tokenizer has <think> and </think> tokens.",
        },
        "max_thinking_tokens": {
            "type": "integer",
            "minimum": 0,
            "description": "Tokens a completion's think block may take (at least one); then "
            "its end (\\n</think>\\n\\n) is forced and the answer follows. Needs <think> "
            "and </think> tokens; a per-row column max_thinking_tokens overrides it.",
        },
        "json_schema": {
            "type": ["string", "object"],
            "description": "Every completion is JSON matching this JSON Schema (JSON text, or "
            'a table), written compactly (", " and ": " between items); a row\'s '
            "json_schema, regex or choice column replaces it. One of json_schema, regex and "
            "choice. Keywords the grammar engine does not enforce are refused (the README "
            "lists those it does).",
        },
        "regex": {
            "type": "string",
            "minLength": 1,
            "description": "Every completion matches this regular expression (whole); a row's "
            "json_schema, regex or choice column replaces it.",
        },
        "choice": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "description": "Every completion is one of these strings; a row's json_schema, "
            "regex or choice column replaces it.",
        },
        "max_constraint_bytes": _integer(
            "A json_schema, regex or choice (its grammar's text) longer than this many bytes is "
            "not compiled: its row is an error row (a job key's: the job is refused).",
            MAX_CONSTRAINT_BYTES,
            1,
        ),
        "grammar_compile_timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": COMPILE_SECONDS,
            "description": "Seconds a constraint's grammar may take to compile (off the step "
            "loop: other rows decode meanwhile); a longer compile is given up and its row is an "
            "error row (a job key's: the job is refused).",
        },
        "ignore_eos": _flag(
            "Generate past end-of-sequence tokens (they are output) until max_tokens or a "
            "stop; a per-row column ignore_eos overrides it.",
            False,
        ),
        "presence_penalty": _number(
            "Subtracted from the logit of each token the output holds so far (vLLM's); a "
            "per-row column presence_penalty overrides it.",
            0.0,
            -2,
            2,
        ),
        "frequency_penalty": _number(
            "Subtracted from a token's logit once per occurrence in the output so far (vLLM's); "
            "a per-row column frequency_penalty overrides it.",
            0.0,
            -2,
            2,
        ),
        "repetition_penalty": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 1.0,
            "description": "Divides the positive logits, and multiplies the negative ones, of "
            "tokens in the prompt or the output so far (transformers' and vLLM's); 1 is off. A "
            "per-row column repetition_penalty overrides it.",
        },
        "min_tokens": _integer(
            "Tokens generated before an end-of-sequence token, a stop token id or a stop string "
            "may end a row (the ids are masked until then); at most max_tokens. A per-row "
            "column min_tokens overrides it.",
            0,
            0,
        ),
        "logit_bias": {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "Token id -> bias added to its logit before sampling, e.g. "
            '{"151645" = -100}; ids must be in the target\'s vocabulary. A per-row column '
            "logit_bias (a JSON object string, or a struct) replaces it.",
        },
        "min_p": _number(
            "After temperature, drop tokens whose probability is below min_p times the most "
            "probable token's (greedy rows are unaffected); 0 is off. A per-row column min_p "
            "overrides it.",
            0.0,
            0,
            1,
        ),
        "logprobs": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_LOGPROBS,
            "description": "Adds completion_logprobs and completion_logprob_sum (each completion "
            "token's log-probability under the distribution it was sampled from: after "
            "logit_bias, min_tokens, the penalties, temperature, min_p, top_k and top_p) "
            "and, when above 0, top_logprobs: that many most probable tokens per position. "
            "Unset: off.",
        },
        "prompt_logprobs": {
            "anyOf": [
                {"type": "boolean"},
                {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            ],
            "description": "true or K (true is 0): adds prompt_logprobs, each prompt token's "
            "log-probability under the target given the tokens before it, and when K is above "
            "0, prompt_top_logprobs: that many most probable tokens per position. Prompts are "
            "then computed in full (no prefix caching). false or unset: off.",
        },
        "dtype": _choice(
            "Model weight and activation dtype.", ["auto", "float32", "bfloat16", "float16"]
        ),
        "device": {
            "type": "string",
            "pattern": "^(auto|cpu|cuda(:[0-9]+)?)$",
            "default": "auto",
            "description": "Device to run on: auto, cpu, cuda or cuda:N (under torchrun, auto "
            "and cuda become cuda:LOCAL_RANK).",
        },
        "attention_backend": _choice(
            "Attention implementation.", ["auto", "torch", "triton", "flashinfer"]
        ),
        "kv_cache_dtype": _choice(
            "The target's KV cache: auto (the model dtype) or fp8 (float8_e4m3fn with a scale "
            "per layer for K and one for V, 1.0 uncalibrated: half the bytes of bfloat16, so "
            "about twice the pages; attention reads the values rounded to 3 mantissa bits, so "
            "outputs may differ from auto's). fp8 runs on the torch and triton backends.",
            ["auto", "fp8"],
        ),
        "cuda_graphs": _flag("Capture CUDA graphs for decode steps (GPU only).", True),
        "prefix_caching": _flag(
            "Reuse the K/V of full pages of prompt tokens that rows share (automatic prefix "
            "caching).",
            True,
        ),
        "verify_width": {
            "anyOf": [{"enum": ["auto", "full"]}, {"type": "integer", "minimum": 1}],
            "default": "auto",
            "description": "Tokens verified per request and step with a draft: auto (chosen each "
            "step from measured step costs and acceptance), full (the draft's block size) or "
            "1 up to the block size.",
        },
        "max_batch_size": _integer(
            f"Requests in flight in the engine at once (at most {MAX_BATCH_SIZE}, and what the "
            "device's memory holds).",
            64,
            1,
        )
        | {"maximum": MAX_BATCH_SIZE},
        "max_batched_tokens": _integer(
            f"Tokens per forward pass (prefill chunks + decode; at most {MAX_BATCHED_TOKENS}, "
            "and what the device's memory holds).",
            4096,
            1,
        )
        | {"maximum": MAX_BATCHED_TOKENS},
        "schedule_window": _integer(
            "Input rows read ahead and admitted sorted: rows sharing a prompt prefix side by "
            "side, the longest first; 0 admits rows in input order. Outputs do not change.",
            4096,
            0,
        ),
        "gpu_memory_fraction": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": 0.9,
            "description": "Fraction of the GPU's memory batchrun may use: the KV pools get "
            "what is left of it after weights, CUDA graphs and activations.",
        },
        "tp": _integer(
            "Tensor parallel size: the target's heads, MLP rows and vocabulary split across this "
            "many processes, one per GPU (gloo processes on a CPU), run under torchrun "
            "(re-executed under it when not launched so). Under a torchrun of WORLD_SIZE "
            "processes, each tp consecutive ranks form one group, a data-parallel shard of "
            "WORLD_SIZE / tp. Outputs do not change.",
            1,
            1,
        ),
        "shard": {
            "type": "string",
            "pattern": "^[0-9]+/[0-9]+$",
            "description": 'Process shard I of N, given as "I/N": whole row groups, one '
            "contiguous run of them with about 1/N of the rows; shards share one output "
            "directory. Unset: from SLURM_ARRAY_TASK_ID/COUNT or RANK/WORLD_SIZE (each "
            "tensor-parallel group one shard) if set, else every row.",
        },
        "overwrite": _flag(
            "Delete this job's earlier output in the output directory first.", False
        ),
        "quiet": _flag("No progress bar on stderr.", False),
        "rows_per_part": _integer("Rows per output part file.", 1000, 1),
        "part_seconds": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 60.0,
            "description": "Commit a part after this many seconds even if it is not full, "
            "so a killed job loses little work.",
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://batchrun.dev/schemas/job.schema.json",
        "title": "batchrun job",
        "description": "A batchrun job file (TOML). Every key is also a command-line flag "
        "(underscores become dashes); flags override the file, the file overrides defaults. "
        "input, output and target are required, from the file or from flags.",
        "type": "object",
        "properties": properties,
        "required": ["input", "output", "target"],
        "additionalProperties": False,
    }


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
    return Path(__file__).resolve().parent.parent / "schemas"


def write_schema_files(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in schema_files().items():
        (directory / name).write_text(text)


if __name__ == "__main__":
    write_schema_files(Path(sys.argv[1]) if len(sys.argv) > 1 else default_schema_dir())
