"""transformers' generate() on the same prompts: eager (dynamic cache) and with a static cache,
which generate() compiles with torch.compile (CUDA graphs) on accelerators. Decode speed is
taken as the difference between two generate() calls of different lengths, so prefill does not
count."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch


def _generate_seconds(model: Any, ids: torch.Tensor, new_tokens: int, static_cache: bool) -> float:
    kwargs: dict[str, Any] = {}
    if static_cache:
        kwargs["cache_implementation"] = "static"
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


RUNS = 3  # timed runs of every baseline: their median and spread are reported


def spread(values: list[float]) -> dict[str, Any]:
    """Every run's value, their median and range."""
    return {
        "runs": values,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def decode_ms_per_step(
    model: Any, prompts: torch.Tensor, steps: int, static_cache: bool, runs: int = RUNS
) -> dict[str, Any]:
    """Milliseconds per decode step of a batch of equal-length prompts [batch, length], timed
    `runs` times (each the difference of a short and a long call). "compiled" is whether
    torch.compile compiled a frame here; with a static cache dynamo's caches are reset first,
    so a graph compiled earlier cannot hide (its compile time is then warm-up minus a run)."""
    if static_cache:
        torch._dynamo.reset()
    before = compiled_frames()
    try:
        warm_up = _generate_seconds(model, prompts, 2, static_cache)  # and compile
        _generate_seconds(model, prompts, 2 + steps, static_cache)
        pairs = [
            (
                _generate_seconds(model, prompts, 2, static_cache),
                _generate_seconds(model, prompts, 2 + steps, static_cache),
            )
            for _ in range(runs)
        ]
    except Exception as exc:  # a failed compile is a result to report, not a crash
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return {"error": error, "compiled": compiled_frames() > before}
    frames = compiled_frames() - before
    ms = spread([(long - short) / steps * 1e3 for short, long in pairs])
    return {
        "ms_per_step": ms["median"],
        "tokens_per_second": prompts.shape[0] / ms["median"] * 1e3,
        "ms_per_step_runs": ms,
        "compiled": frames > 0,
        "compiled_frames": frames,
        "compile_seconds": warm_up - min(s for s, _ in pairs) if frames else None,
    }


def generate_job(
    target: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """transformers' generate() over a job's rows, `batch` at a time, with a static cache
    (which generate() compiles on accelerators), eager where that fails; after one untimed call
    on the first batch (the compile), RUNS timed passes over all. Equal prompt lengths and
    budgets only: generate() pads nothing here."""
    from transformers import AutoModelForCausalLM

    if len({len(p) for p in prompts}) > 1 or len(set(max_tokens)) > 1:
        return {"skipped": "ragged prompts or budgets (one generate() call pads to the longest)"}
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
    model.to(device).eval()  # type: ignore[arg-type]
    new_tokens = max_tokens[0]
    chunks = [
        torch.tensor(prompts[i : i + batch], device=device) for i in range(0, len(prompts), batch)
    ]
    torch._dynamo.reset()
    before = compiled_frames()
    static, failure = True, ""
    try:
        _generate_seconds(model, chunks[0], new_tokens, static_cache=True)
    except Exception as exc:  # a failed compile is a result to report, not a crash
        static, failure = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    compiled = static and compiled_frames() > before  # eager after a failure: not compiled
    runs = [
        sum(_generate_seconds(model, c, new_tokens, static) for c in chunks) for _ in range(RUNS)
    ]
    del model
    tokens = len(prompts) * new_tokens  # min_new_tokens: every row generates them all
    seconds = spread(runs)
    mode = ("static cache, compiled" if compiled else "static cache") if static else "eager"
    return {
        "mode": mode,
        "compiled": compiled,
        **({"static_cache_error": failure} if failure else {}),
        "seconds": seconds["median"],
        "seconds_runs": seconds,
        "tokens_per_second": tokens / seconds["median"],
    }
