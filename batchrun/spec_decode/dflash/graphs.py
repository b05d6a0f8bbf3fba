"""The draft's CUDA graphs: one block per decoding request, captured at the ladder sizes of the
narrowest drafting width's target graphs, on the runner's graph machinery (GraphHost). A graph
reads its requests' slots from the packed step, their context features from a buffer of its
own, and writes its drafts into the buffer the target's graphs read them from."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from batchrun.attention.base import AttentionBackend
from batchrun.attention.meta import AttentionMeta
from batchrun.spec_decode.base import GraphHost, Graphs, StepShape

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
        drafts: torch.Tensor,
        context: torch.Tensor,
        block_size: int,
    ) -> None:
        """backends: those that attend in the draft, in the order of metas(slots)'s metas;
        drafts: [max batch, B-1], where the target's graphs read them; context: [max batch * B,
        features] the buffer the graphs read the context features from."""
        self.host, self.draft, self.backends, self.metas = host, draft, backends, metas
        self.drafts, self.context, self.block_size = drafts, context, block_size
        self.graphs: Graphs | None = None

    def capture(self, sizes: list[int], pool: Any) -> None:
        planned = (self.backends, self.block_size)
        self.graphs = self.host.capture(NAME, self._graph, sizes, planned, pool)

    def replayable(self, step: StepShape) -> bool:
        return self.host.replayable(self.graphs, step)

    def replay(self, size: int, context: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
        """The drafts [size, B-1] of a step of `size` requests (`slots`, padded), after its
        context features are copied in."""
        assert self.graphs is not None
        if context is not None:
            self.context[: context.shape[0]].copy_(context)
        metas = partial(self.metas, slots)
        return self.host.replay(self.graphs, size, self.backends, metas)[0]

    def _graph(self, size: int) -> tuple[torch.Tensor, ...]:
        slots = self.host.slots(size)
        drafts = self.draft(slots, self.context[: size * self.block_size])
        self.drafts[:size].copy_(drafts)  # the target graph reads them here
        return (self.drafts[:size],)
