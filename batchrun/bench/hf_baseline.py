"""transformers' generate() on the same prompts: eager (dynamic cache) and with a static cache,
which generate() compiles with torch.compile (CUDA graphs). Decode speed is taken as the
difference between two generate() calls of different lengths, so prefill does not count."""

from __future__ import annotations

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


def decode_ms_per_step(
    model: Any, prompts: torch.Tensor, steps: int, static_cache: bool
) -> dict[str, Any]:
    """Milliseconds per decode step of a batch of equal-length prompts [batch, length]."""
    try:
        _generate_seconds(model, prompts, 2, static_cache)  # warm-up (and compile)
        _generate_seconds(model, prompts, 2 + steps, static_cache)
        short = _generate_seconds(model, prompts, 2, static_cache)
        long = _generate_seconds(model, prompts, 2 + steps, static_cache)
    except Exception as exc:  # a failed compile is a result to report, not a crash
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    ms = (long - short) / steps * 1e3
    return {"ms_per_step": ms, "tokens_per_second": prompts.shape[0] / ms * 1e3}


def generate_job(
    target: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """transformers' generate() over a job's rows, `batch` at a time, with a static cache
    (which generate() compiles), eager where that fails; after one untimed call on the first
    batch (the compile). Equal prompt lengths and budgets only: generate() pads nothing here."""
    from transformers import AutoModelForCausalLM

    if len({len(p) for p in prompts}) > 1 or len(set(max_tokens)) > 1:
        return {"skipped": "ragged prompts or budgets (one generate() call pads to the longest)"}
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
    model.to(device).eval()  # type: ignore[arg-type]
    new_tokens = max_tokens[0]
    chunks = [
        torch.tensor(prompts[i : i + batch], device=device) for i in range(0, len(prompts), batch)
    ]
    mode, static = "static cache, compiled", True
    try:
        _generate_seconds(model, chunks[0], new_tokens, static_cache=True)
    except Exception as exc:  # a failed compile is a result to report, not a crash
        mode, static = f"eager ({type(exc).__name__} compiled)", False
    seconds = sum(_generate_seconds(model, c, new_tokens, static) for c in chunks)
    del model
    tokens = len(prompts) * new_tokens  # min_new_tokens: every row generates them all
    return {"mode": mode, "seconds": seconds, "tokens_per_second": tokens / seconds}
