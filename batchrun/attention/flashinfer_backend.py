"""Paged attention through flashinfer's planned wrappers (flashinfer-python 0.7.2).

Every forward (prefill and extend chunks, decode, verify, the non-causal DFlash draft block) runs
through a `BatchPrefillWithPagedKVCacheWrapper`; its kernels handle q_len 1 with GQA too, so
decode needs no second wrapper (nor a second JIT module). The caches are flashinfer's "NHD"
layout with separate K and V tensors, [num_pages, page_size, num_kv_heads, head_dim], passed as
the tuple (k_cache, v_cache). RoPE is applied by the model before attention (pos_encoding_mode
"NONE").

`paged_plan` turns the meta into flashinfer's CSR page lists (qo_indptr, paged_kv_indptr,
paged_kv_indices, paged_kv_last_page_len) with vectorised torch ops: request r's pages are the
first ceil(kv_lens[r] / page_size) entries of its page_table row. flashinfer schedules the work
on the host, so planning reads the meta back to the host: one device sync per planned forward.

Eager forwards share one wrapper, planned at the first `attend` of a forward (the heads, head
dim and dtypes are known then; the target and the DFlash draft share the backend) and not again
within it. CUDA graphs (attention/base.py) get a wrapper each, in flashinfer's CUDA-graph mode:
fixed-size page-list buffers that a graph's kernels read. It is planned for the largest step
the graph serves during the warm-up before its capture, and for the real step, from the meta
the runner builds eagerly, before each replay; the replay then needs no planning. Graph steps
keep every request (padding ones too, with one page that no row reads), as the wrapper's batch
size is fixed. Each graph wrapper holds flashinfer's own 8 MiB scheduling workspace (and its
pinned host copy); the 128 MiB float workspace is shared, as one forward runs at a time.

Rows past cu_q[R] belong to no request and come back zero. flashinfer computes in float16 and
bfloat16 only. K/V rows are stored with the same write as the other backends (the Triton kernel
when triton imports, else torch indexing); an index of -1 stores nothing. FP8 KV caches are not
read here: start-up refuses them with this backend (engine/attention_backends.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from batchrun.attention.base import GraphKey, GraphShape
from batchrun.attention.kv_dtype import FP8
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
    """One forward's requests in flashinfer's CSR form, on the host (int32); their rows are
    rows[0]:rows[1] of the forward's batch."""

    qo_indptr: torch.Tensor  # [n + 1]
    kv_indptr: torch.Tensor  # [n + 1], in pages
    kv_indices: torch.Tensor  # [kv_indptr[n]] page ids
    last_page_len: torch.Tensor  # [n], 1 .. page_size
    rows: tuple[int, int]
    causal: bool
    window_left: int = -1  # the meta's window as flashinfer's (see Params)

    @property
    def num_requests(self) -> int:
        return self.last_page_len.shape[0]


def paged_plan(meta: AttentionMeta, keep_all: bool = False) -> PagedPlan:
    """The meta's requests as flashinfer's page lists: the lengths come back to the host (a
    device sync), then the page-table columns they use.
    Requests with no query rows or no K/V are left out, unless keep_all (a graph's fixed batch):
    then each keeps at least one page, which no row reads."""
    num_req, page_size = meta.num_requests, meta.page_size
    lens = torch.cat([meta.cu_q.int(), meta.kv_lens.int()]).cpu()
    cu_q, kv_lens = lens[: num_req + 1].long(), lens[num_req + 1 :].long()
    q_lens = cu_q[1:] - cu_q[:-1]
    if keep_all:
        keep = torch.ones(num_req, dtype=torch.bool)
        kv_lens = kv_lens.clamp(min=1)
    else:
        keep = (q_lens > 0) & (kv_lens > 0)
    q_lens, kv_lens = q_lens[keep], kv_lens[keep]
    num_pages = (kv_lens + page_size - 1) // page_size
    width = int(num_pages.max()) if num_pages.numel() else 0
    if width > min(meta.page_table.shape[1], _pages(meta.max_kv, page_size)):
        raise ValueError(f"a request's K/V is longer than meta.max_kv {meta.max_kv}")
    table = meta.page_table[:, :width].int().cpu()[keep]  # the columns the longest one uses
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


def largest_plan(shape: GraphShape, causal: bool) -> PagedPlan:
    """The largest step a graph serves, over page 0: what its wrapper is first planned for."""
    n, q_len, page_size = shape.num_requests, shape.q_len, shape.page_size
    pages = _pages(shape.max_kv, page_size)
    return PagedPlan(
        qo_indptr=(torch.arange(n + 1) * q_len).int(),
        kv_indptr=(torch.arange(n + 1) * pages).int(),
        kv_indices=torch.zeros(n * pages, dtype=torch.int32),
        last_page_len=torch.full((n,), shape.max_kv - (pages - 1) * page_size, dtype=torch.int32),
        rows=(0, n * q_len),
        causal=causal,
    )


@dataclass(frozen=True)
class Params:
    """What a wrapper is planned for besides the page lists."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float
    causal: bool
    window_left: int  # flashinfer's: a sliding window of W positions is W - 1; -1: none


@dataclass
class GraphWrapper:
    """A graph's own wrapper, its page-list buffers fixed in size and address."""

    wrapper: Any
    shape: GraphShape
    params: Params | None = None  # set at the warm-up's first attend


class FlashInferAttention:
    name = "flashinfer"
    graphable = True
    host_planned = True

    def __init__(self, device: torch.device, write: WriteKV | None = None):
        import flashinfer

        self._flashinfer = flashinfer
        self.device = device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._write: WriteKV = write or write_kv_torch
        self.graphs: dict[GraphKey, GraphWrapper] = {}
        self.paged: PagedPlan | None = None
        self.kv_index: torch.Tensor | None = None
        self.causal = True
        self.window_left = -1
        self._planned: Params | None = None  # what the eager wrapper is planned for
        self._bound: GraphWrapper | None = None  # inside a graph's capture or replay

    # -- graphs -------------------------------------------------------------------------------

    @contextmanager
    def capturing(self, key: GraphKey, shape: GraphShape) -> Iterator[None]:
        if key not in self.graphs:
            n, pages = shape.num_requests, _pages(shape.max_kv, shape.page_size)
            buffers = {
                "qo_indptr_buf": torch.zeros(n + 1, dtype=torch.int32, device=self.device),
                "paged_kv_indptr_buf": torch.zeros(n + 1, dtype=torch.int32, device=self.device),
                "paged_kv_indices_buf": torch.zeros(
                    n * pages, dtype=torch.int32, device=self.device
                ),
                "paged_kv_last_page_len_buf": torch.zeros(n, dtype=torch.int32, device=self.device),
            }
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, **buffers
            )
            self.graphs[key] = GraphWrapper(wrapper, shape)
        with self._bind(self.graphs[key]):
            yield

    @contextmanager
    def replaying(self, key: GraphKey, meta: AttentionMeta) -> Iterator[None]:
        graph = self.graphs[key]
        assert graph.params is not None, "captured before replayed"
        _plan(graph.wrapper, paged_plan(meta, keep_all=True), graph.params)
        with self._bind(graph):
            yield

    @contextmanager
    def _bind(self, graph: GraphWrapper) -> Iterator[None]:
        self._bound = graph
        try:
            yield
        finally:
            self._bound = None

    # -- a forward ----------------------------------------------------------------------------

    def plan(self, meta: AttentionMeta) -> None:
        self.kv_index = meta.kv_index
        self.causal = meta.causal
        self.window_left = -1 if meta.window is None else meta.window - 1
        if self._bound is None:  # a graph's wrapper is planned around its capture or replay
            self.paged = paged_plan(meta)
            self._planned = None

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_index: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,  # unused: no FP8 cache comes here
    ) -> None:
        if kv_index is None:
            assert self.kv_index is not None, "plan() first"
            kv_index = self.kv_index
        self._write(k, v, k_cache, v_cache, kv_index)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_dtype(q.dtype)
        if k_cache.dtype == FP8:
            raise ValueError("the flashinfer backend reads no FP8 KV cache")
        params = Params(
            q.shape[1],
            k_cache.shape[2],
            q.shape[2],
            k_cache.shape[1],
            q.dtype,
            k_cache.dtype,
            scale,
            self.causal,
            self.window_left,
        )
        if self._bound is not None:
            return self._attend_graph(self._bound, params, q, k_cache, v_cache)
        plan = self.paged
        assert plan is not None, "plan() first"
        start, end = plan.rows
        out = torch.empty_like(q)
        out[:start].zero_()  # rows of no request (graph padding) are zero
        out[end:].zero_()
        if plan.num_requests == 0:
            return out
        if params != self._planned:
            _plan(self.wrapper, plan, params)
            self._planned = params
        self.wrapper.run(q[start:end].contiguous(), (k_cache, v_cache), out=out[start:end])
        return out

    def _attend_graph(
        self,
        graph: GraphWrapper,
        params: Params,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """A graph's forward: every row goes in (the planned rows start at 0); rows past the
        planned ones stay zero."""
        if graph.params is None:  # the warm-up before capture: plan for the largest step
            _plan(graph.wrapper, largest_plan(graph.shape, params.causal), params)
            graph.params = params
        elif params != graph.params:
            raise RuntimeError("a graph's attention layers must share heads, dtypes and mask")
        out = torch.zeros_like(q)
        graph.wrapper.run(q, (k_cache, v_cache), out=out)
        return out


def _plan(wrapper: Any, plan: PagedPlan, params: Params) -> None:
    wrapper.plan(
        plan.qo_indptr,
        plan.kv_indptr,
        plan.kv_indices,
        plan.last_page_len,
        params.num_heads,
        params.num_kv_heads,
        params.head_dim,
        params.page_size,
        causal=params.causal,
        pos_encoding_mode="NONE",
        sm_scale=params.scale,
        window_left=params.window_left,
        q_data_type=params.q_dtype,
        kv_data_type=params.kv_dtype,
    )


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
