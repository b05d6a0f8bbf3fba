"""CUDA graphs of the steady-state forwards: every request feeds the same number of rows
(1 for plain decode, B for a DFlash draft block or verify), for a ladder of batch sizes.

The metadata lives in persistent device buffers that every graph of one width reads; a replay
copies the step's metadata into them from pinned host memory, pads the batch up to the
captured size (padding requests feed zero rows, padding rows write no K/V), and replays.
Graphs are captured largest first into one memory pool, as their outputs are never alive at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta, HostMeta

BATCH_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)

Outputs = tuple[torch.Tensor, ...]


def batch_ladder(max_batch_size: int) -> list[int]:
    sizes = [n for n in BATCH_LADDER if n < max_batch_size]
    return [*sizes, max_batch_size]


class StepBuffers:
    """Persistent device metadata for up to max_requests requests of `width` rows each, with
    pinned host staging so each step costs a few small asynchronous copies."""

    def __init__(
        self, max_requests: int, width: int, max_pages: int, page_size: int, device: torch.device
    ) -> None:
        rows = max_requests * width
        self.width, self.page_size, self.device = width, page_size, device

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
            return host, torch.zeros(shape, dtype=dtype, device=device)

        self.positions = pair((rows,), torch.int64)
        self.slots = pair((rows,), torch.int64)
        self.cu_q = pair((max_requests + 1,), torch.int32)
        self.kv_lens = pair((max_requests,), torch.int32)
        self.page_table = pair((max_requests, max_pages), torch.int32)
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
        # The DFlash draft's new context rows, at most `width` per request: padding rows sit at
        # position 0 and slot -1 (nothing written).
        self.ctx_positions = pair((rows,), torch.int64)
        self.ctx_slots = pair((rows,), torch.int64)
        self.ctx_features: torch.Tensor | None = None  # [rows, layers * H], made by the runner

    def load_context(
        self, features: torch.Tensor, positions: np.ndarray, slots: np.ndarray, rows: int
    ) -> None:
        """The draft's new context rows, padded up to `rows` (those of the captured size)."""
        assert self.ctx_features is not None
        n = len(positions)
        pos, slot = self.ctx_positions[0].numpy(), self.ctx_slots[0].numpy()
        pos[:n], pos[n:rows] = positions, 0
        slot[:n], slot[n:rows] = slots, -1
        for staged, device in (self.ctx_positions, self.ctx_slots):
            device[:rows].copy_(staged[:rows], non_blocking=True)
        if n:
            self.ctx_features[:n].copy_(features)

    def meta(self, num_requests: int, causal: bool, max_kv: int) -> AttentionMeta:
        rows = num_requests * self.width
        return AttentionMeta(
            positions=self.positions[1][:rows],
            slot_mapping=self.slots[1][:rows],
            cu_q=self.cu_q[1][: num_requests + 1],
            kv_lens=self.kv_lens[1][:num_requests],
            page_table=self.page_table[1][:num_requests],
            page_size=self.page_size,
            max_q=self.width,
            max_kv=max_kv,
            causal=causal,
        )

    def clear(self, num_requests: int) -> None:
        """Every request padding: zero rows, nothing written (the state graphs are captured in)."""
        self.load(HostMeta.empty(), num_requests)
        if self.ctx_features is not None:
            empty = np.zeros(0, dtype=np.int64)
            self.load_context(self.ctx_features[:0], empty, empty, num_requests * self.width)

    def load(self, host: HostMeta, num_requests: int) -> None:
        """The step's metadata, padded up to num_requests."""
        n, rows = len(host.kv_lens), len(host.positions)
        padded = num_requests * self.width
        pos, slots = self.positions[0].numpy(), self.slots[0].numpy()
        pos[:rows], pos[rows:padded] = host.positions, 0
        slots[:rows], slots[rows:padded] = host.slot_mapping, -1
        cu_q, kv_lens = self.cu_q[0].numpy(), self.kv_lens[0].numpy()
        cu_q[: n + 1], cu_q[n + 1 : num_requests + 1] = host.cu_q, rows
        kv_lens[:n], kv_lens[n:num_requests] = host.kv_lens, 0
        table = self.page_table[0].numpy()
        width = min(host.page_table.shape[1], table.shape[1])
        table[:n, :width] = host.page_table[:, :width]
        for (staged, device), count in (
            (self.positions, padded),
            (self.slots, padded),
            (self.cu_q, num_requests + 1),
            (self.kv_lens, num_requests),
        ):
            device[:count].copy_(staged[:count], non_blocking=True)
        # Only the columns this step's requests use: the kernels read no page past a kv_len.
        self.page_table[1][:n, :width].copy_(self.page_table[0][:n, :width], non_blocking=True)


class GraphSet:
    """One forward function captured at each batch size of a ladder, for one buffer set.

    Off a GPU the graphs are emulated: a replay runs the function on the persistent buffers,
    padded as a real replay would be, so the CPU tests cover everything but the capture itself.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[[AttentionMeta, torch.Tensor], Outputs],
        buffers: StepBuffers,
        backend: AttentionBackend,
        causal: bool,
        max_kv: int,
    ) -> None:
        self.name, self.fn, self.buffers, self.backend = name, fn, buffers, backend
        self.causal, self.max_kv = causal, max_kv
        self.emulated = buffers.device.type != "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, Outputs]] = {}

    def capture(self, sizes: list[int], pool: Any) -> None:
        for size in sorted(sizes, reverse=True):
            if self.emulated:
                self.graphs[size] = (None, ())
                continue
            self.buffers.clear(size)
            meta, ids = self._inputs(size)
            self.backend.plan(meta)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.fn(meta, ids)  # warm-up: lazy initialisation stays out of the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self.fn(meta, ids)
            self.graphs[size] = (graph, outputs)

    def bucket(self, num_requests: int) -> int | None:
        return min((s for s in self.graphs if s >= num_requests), default=None)

    def replay(self, size: int) -> Outputs:
        """Replay the graph of `size` on what the buffers hold (load them first)."""
        graph, outputs = self.graphs[size]
        if graph is None:
            meta, ids = self._inputs(size)
            self.backend.plan(meta)
            return self.fn(meta, ids)
        graph.replay()
        return outputs

    def _inputs(self, size: int) -> tuple[AttentionMeta, torch.Tensor]:
        meta = self.buffers.meta(size, self.causal, self.max_kv)
        return meta, self.buffers.ids[: size * self.buffers.width]
