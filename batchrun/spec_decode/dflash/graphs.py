"""The draft's CUDA graphs: one block per drafting request, captured at the ladder sizes of the
narrowest drafting width's target graphs, on the runner's graph machinery (GraphHost) and keyed
by the drafting count (a step drafts only its rows verifying above width 1). A graph reads its
requests' slots and context features from buffers of its own (padding: the scratch slot) and
writes its drafts into a buffer of its own, in drafting order; the speculator places them at
their requests' rows."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta
from batchrun.spec_decode.base import GraphHost, Graphs

NAME = "draft"

# (slots, context features or None) -> the drafted tokens [R, B-1]
DraftFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


class DraftGraphs:
    def __init__(
        self,
        host: GraphHost,
        *,
        draft: DraftFn,
        backends: list[AttentionBackend],
        metas: Callable[[torch.Tensor], list[AttentionMeta]],
        context: torch.Tensor,
        block_size: int,
        max_batch_size: int,
        scratch_slot: int,
    ) -> None:
        """backends: those that attend in the draft, in the order of metas(slots)'s metas;
        context: [max batch * B, features] the buffer the graphs read the context features
        from; scratch_slot: the slot padding requests draft in (they write nothing)."""
        self.host, self.draft, self.backends, self.metas = host, draft, backends, metas
        self.context, self.block_size = context, block_size
        self.max_batch_size, self.scratch_slot = max_batch_size, scratch_slot
        device = context.device
        self.slots = torch.full((max_batch_size,), scratch_slot, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(max_batch_size, block_size - 1, dtype=torch.int64, device=device)
        self.graphs: Graphs | None = None

    def capture(self, sizes: list[int], pool: Any) -> None:
        planned = (self.backends, self.block_size)
        self.graphs = self.host.capture(NAME, self._graph, sizes, planned, pool)

    def size(self, num_drafting: int) -> int | None:
        """The graph a step drafting `num_drafting` requests replays (None: none captured)."""
        if self.graphs is None:
            return None
        size = self.host.bucket(num_drafting, self.max_batch_size)
        return size if size in self.graphs else None

    def replay(self, size: int, context: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        """The drafts [n, B-1] of the n requests in `slots`, by the graph of `size` >= n,
        after their slots and context features are copied in."""
        assert self.graphs is not None
        n = slots.shape[0]
        self.slots[:n].copy_(slots)
        self.slots[n:size].fill_(self.scratch_slot)
        if context is not None:
            self.context[: context.shape[0]].copy_(context)
        metas = partial(self.metas, self.slots[:size])
        return self.host.replay(self.graphs, size, self.backends, metas)[0][:n]

    def _graph(self, size: int) -> tuple[torch.Tensor, ...]:
        drafts = self.draft(self.slots[:size], self.context[: size * self.block_size])
        self.drafts[:size].copy_(drafts)
        return (self.drafts[:size],)
