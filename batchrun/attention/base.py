"""The one interface every attention backend implements.

A backend object lives with its model runner. Once per forward, outside any CUDA graph, `plan`
takes the forward's AttentionMeta; then every layer writes its new K/V rows and attends. A
backend whose `graphable` is True reads nothing but the meta's tensors after `plan`, so a graph
captured after planning on persistent buffers replays correctly once those buffers are refilled.
"""

from __future__ import annotations

from typing import Protocol

import torch

from batchrun.attention.meta import AttentionMeta


class AttentionBackend(Protocol):
    name: str
    graphable: bool

    def plan(self, meta: AttentionMeta) -> None: ...

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        v_cache: torch.Tensor,
        slots: torch.Tensor | None = None,  # [T] int64; default: the planned slot_mapping
    ) -> None:
        """Store K/V rows at cache slots; a slot of -1 stores nothing."""
        ...

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D] over the planned requests' cached K/V -> [T, Hq, D]."""
        ...
