"""Paged attention through batchrun's Triton kernels (batchrun/kernels/triton_attention.py).

`plan` only keeps the meta: the kernels read everything from its tensors and size their grids
from host ints, so forwards planned on persistent buffers are captured in CUDA graphs as they
are. Decode and verify forwards split each request's K/V range across programs (split-KV)
when the batch alone would leave most of the GPU idle. The split count planned from meta.max_kv
(a graph's: the longest context it serves) is only a maximum: each request uses the splits its
own context fills, so short contexts in a graph captured for long ones pay little for it.
FP8 caches pass their layer's kv_scale to the kernels, which read it on the device.
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
        self.num_splits = 1
        if meta.decoding:  # a mixed step: its decode rows split as a decode step's would
            self.num_splits = self._splits(meta.decoding, meta)
        elif meta.positions.shape[0] <= self.max_decode_rows and meta.num_requests > 0:
            self.num_splits = self._splits(meta.num_requests, meta)

    def _splits(self, num_requests: int, meta: AttentionMeta) -> int:
        """Decode and small verify/draft batches split each request's K/V range when the
        requests alone leave SMs idle, up to what the longest context (or a window) fills."""
        seen = meta.max_kv
        if meta.window is not None:
            seen = min(seen, meta.window + meta.max_q)
        return default_num_splits(num_requests, self.num_kv_heads, seen, max_splits=MAX_SPLITS)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_index: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        if kv_index is None:
            assert self.meta is not None, "plan() first"
            kv_index = self.meta.kv_index
        write_kv(k, v, k_cache, v_cache, kv_index, kv_scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "plan() first"
        caches = (k_cache, v_cache, kv_scale)
        d = meta.decoding
        if not d:
            return self._attend(q, caches, scale, slice(None), meta.max_q, None)
        # A mixed step in two launches: the decode rows with a decode step's small tiles (and
        # splits), then the chunks with prefill tiles. In one launch every decode row took a
        # chunk's tile of BLOCK_Q tokens and the grid a block per max_q / BLOCK_Q for every
        # request. Both write their own rows of one output.
        rows = meta.decode_rows  # each decoding request has at most decode_q of them
        out = torch.empty_like(q)
        self._attend(q[:rows], caches, scale, slice(0, d), meta.decode_q, out[:rows])
        return self._attend(q, caches, scale, slice(d, None), meta.max_q, out, 1)

    def _attend(
        self,
        q: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],  # K, V, kv_scale
        scale: float,
        requests: slice,
        max_q: int,
        out: torch.Tensor | None,
        splits: int | None = None,
    ) -> torch.Tensor:
        """The rows of a range of requests (cu_q keeps their rows' offsets into q)."""
        k_cache, v_cache, kv_scale = caches
        meta = self.meta
        assert meta is not None
        splits = splits or self.num_splits
        if splits > 1 and self.workspace is None:
            self.workspace = attention_workspace(
                MAX_SPLITS, self.max_decode_rows, self.num_heads, self.head_dim, q.device
            )
        first, end = requests.start or 0, requests.stop
        cu_q = meta.cu_q[first : end + 1 if end is not None else None]
        return paged_attention(
            q,
            k_cache,
            v_cache,
            cu_q,
            meta.kv_lens[first:end],
            meta.page_table[first:end],
            scale=scale,
            causal=meta.causal,
            max_q=max_q,
            window=meta.window,
            out=out,
            num_splits=splits,
            workspace=self.workspace if splits > 1 else None,
            kv_scale=kv_scale,
        )
