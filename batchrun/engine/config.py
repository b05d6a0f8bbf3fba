"""Everything the engine needs to know to start, resolved from the job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchrun.errors import JobError
from batchrun.sampling.grammar_compile import CompileBudget


@dataclass(frozen=True)
class EngineConfig:
    target: Path
    draft: Path | None = None
    speculative_method: str = "auto"  # auto: the method the draft's config.json names
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer
    cuda_graphs: bool = True
    max_batch_size: int = 64  # requests in flight
    max_batched_tokens: int = 4096  # tokens per forward (prefill chunks + decode/verify rows)
    gpu_memory_fraction: float = 0.9  # of the GPU's memory: weights, graphs, activations, KV
    page_size: int = 16
    # The target's KV pools: auto (the model dtype) | fp8 (float8_e4m3fn, per-tensor scales).
    kv_cache_dtype: str = "auto"
    num_pages: int | None = None  # None: sized from free memory (GPU) or a fixed budget (CPU)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    verify_width: int | str = "auto"  # rows verified per request and step: auto, full, 1 .. B
    prefix_caching: bool = True  # reuse the K/V of full pages whose tokens a request shares
    logprobs: int | None = None  # score each output token and its k most probable; None: off
    # Score each prompt token and its K most probable (turns prefix caching off); None: off.
    prompt_logprobs: int | None = None
    # Structured outputs: a constraint over its size or its compile time is its row's error.
    compile_budget: CompileBudget = CompileBudget()


def check_batch_budget(max_batched_tokens: int, width: int) -> None:
    """Refuses a token budget that cannot hold one decode/verify step of `width` rows (1, or
    the draft's block size B): the scheduler could never run a request past its prefill."""
    if max_batched_tokens >= width:
        return
    if width == 1:
        raise JobError(f"max_batched_tokens must be at least 1, got {max_batched_tokens}")
    raise JobError(
        f"max_batched_tokens {max_batched_tokens} is below the draft's block size {width}: "
        f"each verify step feeds {width} tokens per request"
    )
