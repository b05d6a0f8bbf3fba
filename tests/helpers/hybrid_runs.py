"""The hybrid engine tests' shared workload: their prompts, a small engine's settings and the
tokens of finished requests."""

from __future__ import annotations

import torch

from batchrun.engine.core.requests import Request
from tests.helpers.hybrid_models import VOCAB

PROMPT_LENGTHS = (1, 5, 13, 30, 47, 9)  # most longer than a prefill chunk (16 rows)
MAX_TOKENS = 12
# Few pages: four running requests outgrow them, so some are preempted and recomputed.
SMALL = {"max_batched_tokens": 16, "max_batch_size": 4, "num_pages": 24, "cuda_graphs": False}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def tokens(requests: list[Request]) -> list[list[int]]:
    return [r.output.token_ids for r in requests]
