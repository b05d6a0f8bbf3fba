"""Paged attention through flashinfer's planned wrappers (flashinfer-python 0.7.2).

Every forward (prefill and extend chunks, decode, verify, the non-causal DFlash draft block) runs
through one `BatchPrefillWithPagedKVCacheWrapper`; its kernels handle q_len 1 with GQA too, so
decode needs no second wrapper (nor a second JIT module). The caches are flashinfer's "NHD"
layout with separate K and V tensors, [num_pages, page_size, num_kv_heads, head_dim], passed as
the tuple (k_cache, v_cache). RoPE is applied by the model before attention (pos_encoding_mode
"NONE").

`plan` turns the meta into flashinfer's CSR page lists (qo_indptr, paged_kv_indptr,
paged_kv_indices, paged_kv_last_page_len) with vectorised torch ops: request r's pages are the
first ceil(kv_lens[r] / page_size) entries of its page_table row. flashinfer's own plan schedules
the work on the host, so `plan` reads the meta back to the host, one device sync per forward. In
this engine a step's metadata is built on the device from per-slot state; a host-side plan would
need that sync inside every step, so this backend is not captured in CUDA graphs
(`graphable = False`): the engine runs it eagerly. The wrapper itself is planned at the first
`attend` of a forward, once the heads, head dim and dtypes are known (the target and the DFlash
draft share one backend), and not again within the forward.

Requests with no query rows (q_len 0, graph padding) or no K/V are left out of the plan; rows
past cu_q[R] belong to no request and come back zero. flashinfer computes in float16 and bfloat16
only. K/V rows are stored with the same write as the other backends (the Triton kernel when
triton imports, else torch indexing); a slot of -1 stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.attention.meta import AttentionMeta
from batchrun.attention.torch_backend import write_kv_torch
from batchrun.errors import JobError

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace
DTYPES = (torch.float16, torch.bfloat16)

WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        name = str(dtype).removeprefix("torch.")
        raise JobError(
            f"attention backend 'flashinfer' runs float16 and bfloat16 only, not {name}; "
            "use --dtype bfloat16 or --attention-backend triton"
        )


@dataclass
class PagedPlan:
    """One forward's requests in flashinfer's CSR form, on the host (int32). Only requests with
    query rows are kept; their rows are rows[0]:rows[1] of the forward's batch."""

    qo_indptr: torch.Tensor  # [n + 1]
    kv_indptr: torch.Tensor  # [n + 1], in pages
    kv_indices: torch.Tensor  # [kv_indptr[n]] page ids
    last_page_len: torch.Tensor  # [n], 1 .. page_size
    rows: tuple[int, int]
    causal: bool
    window_left: int = -1  # a sliding window of W positions is W - 1 here; -1: none

    @property
    def num_requests(self) -> int:
        return self.last_page_len.shape[0]


def paged_plan(meta: AttentionMeta) -> PagedPlan:
    """The meta's requests as flashinfer's page lists; one device -> host copy (the only sync)."""
    num_req, page_size = meta.num_requests, meta.page_size
    # Only the table columns the longest context can use come back to the host.
    width = min(meta.page_table.shape[1], -(-meta.max_kv // page_size))
    packed = torch.cat(
        [meta.cu_q.int(), meta.kv_lens.int(), meta.page_table[:, :width].int().reshape(-1)]
    ).cpu()
    cu_q = packed[: num_req + 1].long()
    kv_lens = packed[num_req + 1 : 2 * num_req + 1].long()
    table = packed[2 * num_req + 1 :].view(num_req, width)
    q_lens = cu_q[1:] - cu_q[:-1]
    keep = (q_lens > 0) & (kv_lens > 0)
    q_lens, kv_lens, table = q_lens[keep], kv_lens[keep], table[keep]
    num_pages = (kv_lens + page_size - 1) // page_size
    if num_pages.numel() and int(num_pages.max()) > width:
        raise ValueError(f"a request's K/V is longer than meta.max_kv {meta.max_kv}")
    zero = torch.zeros(1, dtype=torch.long)
    used = torch.arange(width)[None, :] < num_pages[:, None]  # row-major: request by request
    return PagedPlan(
        qo_indptr=torch.cat([zero, q_lens.cumsum(0)]).int(),
        kv_indptr=torch.cat([zero, num_pages.cumsum(0)]).int(),
        kv_indices=table[used].int(),
        last_page_len=(kv_lens - (num_pages - 1) * page_size).int(),
        rows=(int(cu_q[0]), int(cu_q[-1])),
        causal=meta.causal,
        window_left=-1 if meta.window is None else meta.window - 1,
    )


class FlashInferAttention:
    name = "flashinfer"
    graphable = False  # flashinfer plans on the host: one sync per forward (module docstring)

    def __init__(self, device: torch.device, write: WriteKV | None = None):
        import flashinfer

        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._write: WriteKV = write or write_kv_torch
        self.paged: PagedPlan | None = None
        self.slot_mapping: torch.Tensor | None = None
        self._planned: tuple[Any, ...] | None = None  # what the wrapper is planned for

    def plan(self, meta: AttentionMeta) -> None:
        self.paged = paged_plan(meta)
        self.slot_mapping = meta.slot_mapping
        self._planned = None

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> None:
        if slots is None:
            assert self.slot_mapping is not None, "plan() first"
            slots = self.slot_mapping
        self._write(k, v, k_cache, v_cache, slots)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        plan = self.paged
        assert plan is not None, "plan() first"
        start, end = plan.rows
        out = torch.empty_like(q)
        out[:start].zero_()  # rows of no request (graph padding) are zero
        out[end:].zero_()
        if plan.num_requests == 0:
            return out
        num_heads, num_kv_heads, head_dim = q.shape[1], k_cache.shape[2], q.shape[2]
        key = (num_heads, num_kv_heads, head_dim, k_cache.shape[1], q.dtype, k_cache.dtype, scale,
               plan.window_left)  # fmt: skip
        if key != self._planned:
            check_dtype(q.dtype)
            self.wrapper.plan(
                plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len,
                num_heads, num_kv_heads, head_dim, k_cache.shape[1],
                causal=plan.causal, pos_encoding_mode="NONE", sm_scale=scale,
                window_left=plan.window_left,
                q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            )  # fmt: skip
            self._planned = key
        self.wrapper.run(q[start:end].contiguous(), (k_cache, v_cache), out=out[start:end])
        return out
