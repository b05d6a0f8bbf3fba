"""The job benchmark's workloads: Parquet inputs of random token ids, shaped as the jobs users
run (equal prompts in waves, ragged prompts and budgets, long generations, one row at a time,
JSON-schema rows).
`scale` shrinks rows and lengths alike, for a small model (the CPU test)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


@dataclass(frozen=True)
class Workload:
    name: str
    rows: int
    prompt_len: tuple[int, int]  # a range: equal ends are one length, else log-uniform in it
    max_tokens: tuple[int, int]  # likewise, per row
    batch: int  # --max-batch-size
    json_schema: str | None = None  # every row's json_schema cell (a structured-output job)

    def scaled(self, scale: float) -> Workload:
        def size(n: int) -> int:
            return max(1, round(n * scale))

        def span(r: tuple[int, int]) -> tuple[int, int]:
            return (size(r[0]), size(r[1]))

        return Workload(
            self.name,
            size(self.rows),
            span(self.prompt_len),
            span(self.max_tokens),
            max(1, min(self.batch, size(self.rows))),
            self.json_schema,
        )

    @property
    def ragged(self) -> bool:
        return self.prompt_len[0] != self.prompt_len[1] or self.max_tokens[0] != self.max_tokens[1]

    def rows_of(self, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
        """Prompts and per-row max_tokens (ids below 3 left out: special tokens of small
        tokenizers)."""
        rng = random.Random(f"{self.name}-{seed}")
        prompts, budgets = [], []
        for _ in range(self.rows):
            length = _log_uniform(rng, *self.prompt_len)
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
            budgets.append(_log_uniform(rng, *self.max_tokens))
        return prompts, budgets

    def write(self, path: Path, vocab: int, seed: int, constrained: bool = True) -> Path:
        """Its rows as Parquet; constrained=False leaves the json_schema column out."""
        prompts, budgets = self.rows_of(vocab, seed)
        columns = {"prompt_token_ids": pa.array(prompts, pa.list_(pa.int64()))}
        if self.ragged:
            columns["max_tokens"] = pa.array(budgets, pa.int64())
        if self.json_schema is not None and constrained:
            columns["json_schema"] = pa.array([self.json_schema] * self.rows, pa.string())
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(columns), path)
        return path


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    if low == high:
        return low
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


# An extraction job's schema: a list of records that 256 tokens never finish, so a constrained
# row generates as many tokens as the unconstrained one it is measured against.
RECORDS_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 100,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 8, "maxLength": 24},
                        "price": {"type": "integer", "minimum": 0, "maximum": 9999},
                        "in_stock": {"type": "boolean"},
                        "tags": {
                            "type": "array",
                            "items": {"enum": ["new", "sale"]},
                            "maxItems": 3,
                        },
                    },
                    "required": ["name", "price", "in_stock", "tags"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    }
)

WORKLOADS = {
    w.name: w
    for w in (
        Workload("w1", 256, (1024, 1024), (256, 256), 128),
        Workload("w2", 64, (1024, 1024), (256, 256), 32),
        Workload("w3", 1000, (32, 4096), (16, 1024), 256),
        Workload("w4", 128, (128, 128), (2048, 2048), 128),
        Workload("b1", 4, (512, 512), (256, 256), 1),
        # Structured output: runs "json" (every row constrained) beside "none" (unconstrained).
        Workload("j1", 64, (512, 512), (256, 256), 64, RECORDS_SCHEMA),
    )
}


def named_workload(name: str) -> Workload | None:
    """A workload by name, or NAME@B: that workload at batch B (a batch sweep); None if none."""
    base, _, batch = name.partition("@")
    found = WORKLOADS.get(base)
    if found is None or (batch and not (batch.isdigit() and int(batch) > 0)):
        return None
    return dataclasses.replace(found, name=name, batch=int(batch)) if batch else found
