"""Everything the engine needs to know to start, resolved from the job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    target: Path | None  # None: models built in memory (`batchrun bench --shape`)
    draft: Path | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer
    cuda_graphs: bool = True
    max_batch_size: int = 64  # requests in flight
    max_batched_tokens: int = 2048  # tokens per forward (prefill chunks + decode/verify rows)
    page_size: int = 16
    num_pages: int | None = None  # None: sized from free memory (GPU) or a fixed budget (CPU)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
