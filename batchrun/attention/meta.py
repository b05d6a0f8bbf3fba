"""What one batched forward needs to read and write the paged KV cache, and how it is built.

Tokens of all scheduled requests are packed into one flat batch; request r owns the rows
cu_q[r]:cu_q[r+1]. Position i of a request lives at cache index page_table[r, i // page_size]
* page_size + i % page_size of every layer's cache. A row whose index is -1 is padding: it writes
no K/V (CUDA-graph batches are padded up to their captured size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMeta:
    positions: torch.Tensor  # [T] int64, position of each row
    kv_index: torch.Tensor  # [T] int64, the cache index each row's K/V goes to (-1: none)
    cu_q: torch.Tensor  # [R+1] int32, row offsets per request
    kv_lens: torch.Tensor  # [R] int32, cached length after this forward's writes
    page_table: torch.Tensor  # [R, max_pages] int32, padded with 0
    page_size: int
    max_q: int  # host-side maxima, so no device sync is needed to size buffers or grids
    max_kv: int
    causal: bool = True  # False: every row sees all kv_lens[r] cached positions (DFlash draft)
    # A sliding window: a row at position q sees only positions > q - window (None: all).
    window: int | None = None
    # A mixed step: requests [0, decoding) decode, at most decode_q rows each and decode_rows
    # in all (cu_q[decoding], known on the host), and prefill chunks follow. A backend may
    # attend the two parts with tiles of their own (0: one part).
    decoding: int = 0
    decode_q: int = 0
    decode_rows: int = 0

    @property
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]


def kv_indices(
    page_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """The cache index of position positions[t] of request req[t] (int64)."""
    pages = page_table[req, torch.div(positions, page_size, rounding_mode="floor")].long()
    return pages * page_size + positions % page_size


def row_starts(lengths: torch.Tensor) -> torch.Tensor:
    """The first packed row of each request, its rows after those of the requests before it."""
    return torch.cumsum(lengths, 0) - lengths


def padded_rows(
    start: torch.Tensor, length: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Requests whose rows are packed by offsets (request r's: start[r] .. start[r] +
    length[r] - 1, each length at most `width`) seen as a [R, width] grid: the packed row of
    each cell (clamped to the request's last row, or its start when it has none) and whether
    the cell is one of its rows. With no host sync (captured in CUDA graphs)."""
    j = torch.arange(width, device=start.device)[None, :]
    valid = j < length[:, None]
    last = (length - 1).clamp(min=0)[:, None]
    return start[:, None] + torch.minimum(j, last), valid


def allocate_kv(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_pages, page_size, num_kv_heads, head_dim]."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]
