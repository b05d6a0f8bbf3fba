"""The one interface every attention backend implements.

A backend object lives with its model runner. Once per forward `plan` takes the forward's
AttentionMeta; then every layer writes its new K/V rows and attends.

CUDA graphs. A backend planned on the device (`host_planned` False: Triton) reads nothing but
the meta's tensors after `plan`, so a graph captured with its planning inside replays correctly
once the persistent buffers it reads are refilled. A backend planned on the host (`host_planned`
True: flashinfer, whose scheduler runs on the CPU) gives each graph fixed-size planning buffers:
the runner opens `capturing` around a graph's capture and `replaying`, with the step's meta
built eagerly, around each replay; `plan` inside either does no host work.

FP8 caches (attention/kv_dtype.py). A cache in float8_e4m3fn comes with its layer's kv_scale,
[2] float32 on the device (K's, V's): `write_kv` stores x / scale, `attend` reads stored * scale.
A cache in the model dtype ignores kv_scale.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from batchrun.attention.meta import AttentionMeta

GraphKey = tuple[str, int]  # (graph set, batch size)


@dataclass(frozen=True)
class GraphShape:
    """The largest step a graph serves: what a host-planned backend sizes its buffers for."""

    num_requests: int
    q_len: int  # rows per request
    max_kv: int
    page_size: int


class AttentionBackend(Protocol):
    name: str
    graphable: bool
    host_planned: bool

    def plan(self, meta: AttentionMeta) -> None: ...

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
        v_cache: torch.Tensor,
        kv_index: torch.Tensor | None = None,  # [T] int64; default: the planned meta's
        kv_scale: torch.Tensor | None = None,  # [2] float32: an FP8 cache's K and V scales
    ) -> None:
        """Store K/V rows at their cache index (page * page_size + offset); -1 stores nothing."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] over the planned requests' cached K/V -> [T, Hq, D]."""
        ...


class HostPlanned(AttentionBackend, Protocol):
    """A backend whose graphs are planned on the host before each replay."""

    def capturing(self, key: GraphKey, shape: GraphShape) -> AbstractContextManager[None]:
        """Around a graph's warm-up and capture."""
        ...

    def replaying(self, key: GraphKey, meta: AttentionMeta) -> AbstractContextManager[None]:
        """Around a replay: plans the graph's buffers for this step's meta."""
        ...
