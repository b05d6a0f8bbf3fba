"""Everything the engine needs to know to start, resolved from the job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchrun.engine.options import EngineOptions
from batchrun.errors import JobError


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

    @property
    def batch_size(self) -> int:
        """max_batch_size, given or chosen at start-up (engine/batch_choice.py), which comes
        before anything is sized by it."""
        if self.max_batch_size is None:
            raise JobError("max_batch_size is read before start-up has chosen it")
        return self.max_batch_size


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
