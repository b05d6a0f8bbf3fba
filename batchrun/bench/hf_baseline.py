"""transformers' generate() on the same prompts: eager (dynamic cache) and with a static cache,
which generate() compiles with torch.compile (CUDA graphs). Decode speed is taken as the
difference between two generate() calls of different lengths, so prefill does not count."""

from __future__ import annotations

import time
from typing import Any

import torch


def _generate_seconds(model: Any, ids: torch.Tensor, new_tokens: int, static_cache: bool) -> float:
    kwargs: dict[str, Any] = {}
    if static_cache:
        kwargs["cache_implementation"] = "static"
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs,
        )  # fmt: skip
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
