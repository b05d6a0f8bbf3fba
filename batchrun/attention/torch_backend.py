"""Reference paged attention in plain torch: runs anywhere, the oracle for the GPU kernels.

Per forward, `plan` turns the metadata into padded gather indices and a mask once; each layer
then gathers its K/V pages into [R, max_kv] and runs one batched SDPA. Planning reads the meta's
values on the host's schedule, so this backend runs eagerly only (no CUDA graphs). An FP8 cache
is quantized as it is written and what each layer gathers dequantized (attention/kv_dtype.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.attention.kv_dtype import FP8, dequantize, quantize
from batchrun.attention.meta import AttentionMeta


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_index: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store K/V rows [T, Hkv, D] at their cache index [T]; -1 stores nothing. FP8 caches
    store x / kv_scale (K's, V's), saturated and rounded."""
    keep = kv_index >= 0
    hkv, dim = k.shape[1], k.shape[2]
    if k_cache.dtype == FP8:  # stored as bytes: not every device indexes float8 tensors
        assert kv_scale is not None, "an FP8 cache needs its kv_scale"
        k, v = _bytes(quantize(k, kv_scale[0])), _bytes(quantize(v, kv_scale[1]))
        k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
    k_cache.view(-1, hkv, dim)[kv_index[keep]] = k[keep]
    v_cache.view(-1, hkv, dim)[kv_index[keep]] = v[keep]


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


class TorchAttention:
    name = "torch"
    graphable = False
    host_planned = False

    def plan(self, meta: AttentionMeta) -> None:
        device = meta.positions.device
        num_req = meta.num_requests
        cu_q = meta.cu_q.long()
        q_lens = cu_q[1:] - cu_q[:-1]
        # Row t belongs to request req_of_row[t] at padded query slot col_of_row[t].
        req_of_row = torch.repeat_interleave(torch.arange(num_req, device=device), q_lens)
        col_of_row = torch.arange(req_of_row.numel(), device=device) - cu_q[req_of_row]
        kv_pos = torch.arange(meta.max_kv, device=device)
        pages = meta.page_table.long()[:, kv_pos // meta.page_size]
        self.kv_index_table = pages * meta.page_size + kv_pos % meta.page_size  # [R, max_kv]
        q_pos = torch.full((num_req, meta.max_q), -1, dtype=torch.long, device=device)
        q_pos[req_of_row, col_of_row] = meta.positions[: req_of_row.numel()]
        visible = kv_pos[None, None, :] < meta.kv_lens.long()[:, None, None]
        if meta.causal:
            visible = visible & (kv_pos[None, None, :] <= q_pos[:, :, None])
        if meta.window is not None:
            visible = visible & (kv_pos[None, None, :] > q_pos[:, :, None] - meta.window)
        visible = visible | (q_pos[:, :, None] < 0)  # padded queries: any finite row, dropped
        self.mask = visible.unsqueeze(1)  # [R, 1, max_q, max_kv]
        self.req_of_row, self.col_of_row = req_of_row, col_of_row
        self.max_q = meta.max_q
        self.kv_index = meta.kv_index

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_index: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        index = self.kv_index if kv_index is None else kv_index
        write_kv_torch(k, v, k_cache, v_cache, index, kv_scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_req = self.mask.shape[0]
        out = torch.zeros_like(q)  # rows of no request (graph padding) stay zero
        if num_req == 0:
            return out
        hq, hkv, dim = q.shape[1], k_cache.shape[2], q.shape[2]
        fp8 = k_cache.dtype == FP8
        if fp8:  # gathered as bytes (as write_kv_torch stores them)
            k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
        keys = k_cache.view(-1, hkv, dim)[self.kv_index_table].transpose(
            1, 2
        )  # [R, Hkv, max_kv, D]
        values = v_cache.view(-1, hkv, dim)[self.kv_index_table].transpose(1, 2)
        if fp8:
            assert kv_scale is not None, "an FP8 cache needs its kv_scale"
            keys = dequantize(keys.view(FP8), kv_scale[0], q.dtype)
            values = dequantize(values.view(FP8), kv_scale[1], q.dtype)
        if hq != hkv:
            keys = keys.repeat_interleave(hq // hkv, dim=1)
            values = values.repeat_interleave(hq // hkv, dim=1)
        rows = self.req_of_row.numel()
        q_pad = q.new_zeros(num_req, self.max_q, hq, dim)
        q_pad[self.req_of_row, self.col_of_row] = q[:rows]
        attended = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys, values, attn_mask=self.mask, scale=scale
        )
        out[:rows] = attended.transpose(1, 2)[self.req_of_row, self.col_of_row]
        return out
