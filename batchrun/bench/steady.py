"""The engine's steady state, for `batchrun bench`: requests prefilled and decoding, the
rollback of a hybrid target's verify steps timed apart, and a profile of some of its steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from batchrun.bench.prompts import random_prompts
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.sampling.params import SamplingParams


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed_rollbacks(engine: Engine) -> Iterator[list[float]]:
    """While open, every verify step's rollback on a hybrid target (`commit_linear`: the conv
    inputs moved past the rows kept, the kept rows handed to each slot's next step, whose pass
    over the state takes them) is timed on the device's clock; the list it yields holds their
    milliseconds once it closes. It stays empty for a target without linear layers and for
    steps that verify nothing (their rows updated the states in the forward)."""
    runner = engine.runner
    plain = runner.commit_linear
    spans: list[Callable[[], float]] = []
    times: list[float] = []

    def commit_linear(out: Any, accepted: torch.Tensor) -> None:
        if out.linear is None or not out.linear.verify:
            return plain(out, accepted)
        if engine.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            plain(out, accepted)
            end.record()
            spans.append(lambda: start.elapsed_time(end))
        else:  # the CPU runs it as it is called
            began = time.perf_counter()
            plain(out, accepted)
            elapsed = (time.perf_counter() - began) * 1e3
            spans.append(lambda: elapsed)
        return None

    runner.commit_linear = commit_linear  # type: ignore[method-assign]
    try:
        yield times
    finally:
        del runner.commit_linear  # the class's method again
        sync(engine.device)
        times.extend(span() for span in spans)


def start_decoding(engine: Engine, batch: int, context: int, **sampling: Any) -> list[Request]:
    """`batch` requests prefilled and two steps into decoding (at the pinned verify width, if
    any): the steady state to time. sampling: more SamplingParams for every request."""
    prompts = random_prompts(engine.vocab_size, batch, context)
    params = SamplingParams(max_tokens=engine.max_model_len - context - 1, **sampling)
    reqs = [Request(i, p, params) for i, p in enumerate(prompts)]
    for req in reqs:
        engine.add(req)
    while any(not r.output.token_ids for r in reqs):  # prefill, in chunks
        engine.step()
    for _ in range(2):
        engine.step()
    return reqs


def profile_point(engine: Engine, batch: int, context: int, steps: int) -> str:
    """The kernels of `steps` steady-state steps (graph replays included), as a table of the
    most expensive ones: by GPU time on a GPU, by CPU time on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    start_decoding(engine, batch, context)
    sync(engine.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(engine.device)
    engine.abort_all()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table: str = prof.key_averages().table(sort_by=key, row_limit=30)
    return table
