"""Running a test's requests through an engine to the end, the way the engine tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams

Job = tuple[list[int], SamplingParams]


def requests_of(jobs: list[Job]) -> list[Request]:
    """One request per (prompt, params), row_index its position."""
    return [
        Request(row_index=i, prompt_ids=list(p), params=params)
        for i, (p, params) in enumerate(jobs)
    ]


def run_to_end(engine: Engine, requests: list[Request]) -> list[Request]:
    """Add every request, step until none is unfinished; the finished requests (each sample of
    a row its own) by (row_index, sample_index)."""
    for req in requests:
        engine.add(req)
    finished: list[Request] = []
    while engine.num_unfinished:
        finished += engine.step()
    return sorted(finished, key=lambda r: (r.row_index, r.sample_index))


def cpu_engine(target: Path, draft: Path | None, **settings: Any) -> Engine:
    """An engine on the CPU in float32 with the torch attention backend (pages of 4 tokens
    unless settings say otherwise)."""
    config = {"page_size": 4, **settings}
    return Engine(
        EngineConfig(
            target=target,
            draft=draft,
            device="cpu",
            dtype="float32",
            attention_backend="torch",
            **config,
        )
    )
