"""The batch a job runs at when it sets none, as vLLM sizes max_num_seqs by the KV cache it can
hold: from the decode step's cost and the device's memory. A decode step reads the weights once
and each request's K/V; while that reading bounds it, a request more costs the step little, so
the batch doubles; it stops at the first batch whose rows' matmuls outlast the reading (past it a
request costs its full share: the tokens per second no longer grow) or whose rows no longer fit
the KV pages that memory holds at that batch (a larger batch also reserves more for its graphs
and activations, engine/memory.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchrun.engine.options import MAX_BATCH_SIZE


@dataclass(frozen=True)
class DecodeCost:
    """Milliseconds of a decode step's parts, as bench/replay/fitted.py names them."""

    weights_ms: float  # the weights, read once a step
    ms_per_kv_token: float  # each K/V token a request reads
    ms_per_row: float  # each row's matmuls

    @classmethod
    def roofline(
        cls,
        weight_bytes: int,
        kv_bytes_per_token: int,
        flops_per_row: float,
        bytes_per_s: float,
        flops_per_s: float,
    ) -> DecodeCost:
        """From the model's sizes and the device's copy and matmul rates."""
        return cls(
            weights_ms=1e3 * weight_bytes / bytes_per_s,
            ms_per_kv_token=1e3 * kv_bytes_per_token / bytes_per_s,
            ms_per_row=1e3 * flops_per_row / flops_per_s,
        )

    def memory_bound(self, batch: int, context: float) -> bool:
        """Whether reading the weights and `batch` requests' K/V of `context` tokens each takes
        at least as long as the batch's matmuls."""
        reading = self.weights_ms + self.ms_per_kv_token * context * batch
        return self.ms_per_row * batch <= reading


def default_batch_size(
    cost: DecodeCost,
    prompt_tokens: int,
    output_tokens: int,
    pages_at: Callable[[int], int],
    page_size: int,
    limit: int = MAX_BATCH_SIZE,
) -> int:
    """The largest power of two (a CUDA graph's bucket) up to `limit` reached by doubling from 1
    while the step at the batch so far is memory-bound, its rows reading a row's mean context
    (the prompt and half the output), and the KV pool sized for the doubled batch (pages_at: its
    pages) holds that many whole rows."""
    context = prompt_tokens + output_tokens / 2
    row_pages = -(-(prompt_tokens + output_tokens) // page_size)
    batch = 1
    while batch * 2 <= limit and cost.memory_bound(batch, context):
        if pages_at(batch * 2) < batch * 2 * row_pages:
            break
        batch *= 2
    return batch
