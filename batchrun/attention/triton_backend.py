"""Paged attention through batchrun's Triton kernels (batchrun/kernels/triton_attention.py).

`plan` only keeps the meta: the kernels read everything from its tensors and size their grids
from host ints, so forwards planned on persistent buffers are captured in CUDA graphs as they
are. Decode and verify forwards split each request's K/V range across programs (split-KV)
when the batch alone would leave most of the GPU idle. The split count planned from meta.max_kv
(a graph's: the longest context it serves) is only a maximum: each request uses the splits its
own context fills, so short contexts in a graph captured for long ones pay little for it.
"""

from __future__ import annotations

import torch

from batchrun.attention.meta import AttentionMeta
from batchrun.kernels.triton_attention import (
    AttentionWorkspace,
    attention_workspace,
    default_num_splits,
    paged_attention,
    write_kv,
)

MAX_SPLITS = 16


class TritonAttention:
    name = "triton"
    graphable = True
    host_planned = False

    def __init__(self, max_decode_rows: int, num_heads: int, num_kv_heads: int, head_dim: int):
        self.max_decode_rows = max_decode_rows  # forwards of at most this many rows may split
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.workspace: AttentionWorkspace | None = None  # allocated once, never replaced
        self.meta: AttentionMeta | None = None
        self.num_splits = 1

    def plan(self, meta: AttentionMeta) -> None:
        self.meta = meta
        rows = meta.positions.shape[0]
        self.num_splits = 1
        # Decode and small verify/draft batches: split when the requests alone leave SMs idle,
        # up to what the longest context (or a sliding window) can fill.
        if rows <= self.max_decode_rows and meta.num_requests > 0:
            seen = meta.max_kv
            if meta.window is not None:
                seen = min(seen, meta.window + meta.max_q)
            self.num_splits = default_num_splits(
                meta.num_requests, self.num_kv_heads, seen, max_splits=MAX_SPLITS
            )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> None:
        if slots is None:
            assert self.meta is not None, "plan() first"
            slots = self.meta.slot_mapping
        write_kv(k, v, k_cache, v_cache, slots)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "plan() first"
        splits = self.num_splits
        if splits > 1 and self.workspace is None:
            self.workspace = attention_workspace(
                MAX_SPLITS, self.max_decode_rows, self.num_heads, self.head_dim, q.device
            )
        return paged_attention(
            q, k_cache, v_cache, meta.cu_q, meta.kv_lens, meta.page_table,
            scale=scale, causal=meta.causal, max_q=meta.max_q, window=meta.window,
            num_splits=splits, workspace=self.workspace if splits > 1 else None,
        )  # fmt: skip
