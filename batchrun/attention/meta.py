"""What one batched forward needs to read and write the paged KV cache, and how it is built.

Tokens of all scheduled requests are packed into one flat batch; request r owns the rows
cu_q[r]:cu_q[r+1]. Position i of a request lives in slot page_table[r, i // page_size] *
page_size + i % page_size of every layer's cache. A row whose slot is -1 is padding: it writes
no K/V (CUDA-graph batches are padded up to their captured size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMeta:
    positions: torch.Tensor  # [T] int64, position of each row
    slot_mapping: torch.Tensor  # [T] int64, cache slot each row's K/V is written to (-1: none)
    cu_q: torch.Tensor  # [R+1] int32, row offsets per request
    kv_lens: torch.Tensor  # [R] int32, cached length after this forward's writes
    page_table: torch.Tensor  # [R, max_pages] int32, padded with 0
    page_size: int
    max_q: int  # host-side maxima, so no device sync is needed to size buffers or grids
    max_kv: int
    causal: bool = True  # False: every row sees all kv_lens[r] cached positions (DFlash draft)

    @property
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]


@dataclass(frozen=True)
class HostMeta:
    """A forward's metadata as numpy arrays, built without a Python loop over tokens."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    cu_q: np.ndarray  # [R+1] int32
    kv_lens: np.ndarray  # [R] int32
    page_table: np.ndarray  # [R, max_pages] int32
    max_q: int
    max_kv: int

    @staticmethod
    def empty() -> HostMeta:
        return host_meta(np.zeros(0, np.int64), np.zeros(0, np.int64), [], 1)


def host_meta(
    starts: np.ndarray, q_lens: np.ndarray, page_tables: list[list[int]], page_size: int
) -> HostMeta:
    """Request r feeds q_lens[r] rows at positions starts[r] .. starts[r] + q_lens[r] - 1."""
    starts = starts.astype(np.int64)
    q_lens = q_lens.astype(np.int64)
    num_req = len(q_lens)
    cu_q = np.zeros(num_req + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    width = max((len(t) for t in page_tables), default=0)
    table = np.zeros((num_req, max(width, 1)), dtype=np.int32)
    for r, pages in enumerate(page_tables):  # per request, not per token
        table[r, : len(pages)] = pages
    row_req = np.repeat(np.arange(num_req), q_lens)
    positions = np.arange(int(cu_q[-1]), dtype=np.int64) - cu_q[row_req] + starts[row_req]
    slots = table[row_req, positions // page_size].astype(np.int64) * page_size
    slots += positions % page_size
    kv_lens = starts + q_lens
    return HostMeta(
        positions=positions,
        slot_mapping=slots,
        cu_q=cu_q.astype(np.int32),
        kv_lens=kv_lens.astype(np.int32),
        page_table=table,
        max_q=int(q_lens.max(initial=0)),
        max_kv=int(kv_lens.max(initial=0)),
    )


def device_meta(
    host: HostMeta, page_size: int, device: torch.device, causal: bool = True
) -> AttentionMeta:
    """Eager forwards: copy the host metadata to the device (pinned, asynchronous on a GPU)."""

    def put(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if device.type == "cuda":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)

    return AttentionMeta(
        positions=put(host.positions),
        slot_mapping=put(host.slot_mapping),
        cu_q=put(host.cu_q),
        kv_lens=put(host.kv_lens),
        page_table=put(host.page_table),
        page_size=page_size,
        max_q=host.max_q,
        max_kv=host.max_kv,
        causal=causal,
    )


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
