"""Everything the engine needs to know to start, resolved from the job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchrun.engine.options import EngineOptions
from batchrun.errors import JobError
from batchrun.spec_decode.dflash.width_policy import candidate_widths


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """The job's engine options (engine/options.py declares them and their defaults), the
    models, and what the engine is told beyond them (tests and benchmarks set the pages)."""

    target: Path
    draft: Path | None = None
    page_size: int = 16
    num_pages: int | None = None  # None: sized from free memory (GPU) or a fixed budget (CPU)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    logprobs: int | None = None  # score each output token and its k most probable; None: off
    # Score each prompt token and its K most probable (turns prefix caching off); None: off.
    prompt_logprobs: int | None = None


def verify_widths(verify_width: int | str, block_size: int | None) -> tuple[int, ...]:
    """The verify widths the engine may pick (CUDA graphs are captured for each): every
    candidate under `auto`, the block under `full`, else the one asked for; (1,) without a
    draft."""
    if block_size is None:
        return (1,)
    if verify_width == "auto":
        return candidate_widths(block_size)
    if verify_width == "full":
        return (block_size,)
    if not (isinstance(verify_width, int) and 1 <= verify_width <= block_size):
        raise JobError(
            f"verify width must be auto, full or 1 .. {block_size} (the draft's block size), "
            f"got {verify_width!r}"
        )
    return (verify_width,)


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
