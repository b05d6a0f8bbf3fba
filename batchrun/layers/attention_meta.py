"""What one batched forward needs to read and write the paged KV cache.

Tokens of all scheduled requests are packed into one flat batch; request r owns the rows
cu_q[r]:cu_q[r+1]. Position i of a request lives in slot page_table[r, i // page_size] *
page_size + i % page_size of every layer's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMeta:
    positions: torch.Tensor  # [T] int64, position of each row
    slot_mapping: torch.Tensor  # [T] int64, cache slot each row's K/V is written to
    cu_q: torch.Tensor  # [R+1] int32, row offsets per request
    kv_lens: torch.Tensor  # [R] int32, cached length after this forward's writes
    page_table: torch.Tensor  # [R, max_pages] int32, padded with 0
    page_size: int
    max_q: int  # host-side maxima, so no device sync is needed to size buffers
    max_kv: int
    causal: bool = True  # False: every row sees all kv_lens[r] cached positions (DFlash draft)

    @property
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]
