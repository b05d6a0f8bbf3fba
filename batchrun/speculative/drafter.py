"""DFlash drafting for a step: gather every request's newly committed target features into the
draft's context cache, then draft one block (anchor + B-1 masks) per request about to verify.

It works on plain arrays and a runner that owns the models, KV pools and graphs (DraftRunner):
nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from batchrun.attention.meta import HostMeta, host_meta


class DraftRunner(Protocol):
    page_size: int
    device: torch.device

    def write_draft_context(
        self, features: torch.Tensor, positions: np.ndarray, slots: np.ndarray
    ) -> None: ...

    def draft_block(self, block_ids: torch.Tensor, host: HostMeta) -> torch.Tensor: ...


@dataclass
class ContextRows:
    """One request's new context rows: target features of tokens start .. start + n - 1."""

    features: torch.Tensor  # [n, layers * H]
    start: int
    pages: list[int]


def write_context(runner: DraftRunner, rows: list[ContextRows]) -> None:
    """Store the draft K/V of every request's new context rows, in one eager forward."""
    if not rows:
        return
    size = runner.page_size
    positions, slots = [], []
    for r in rows:
        pos = np.arange(r.start, r.start + r.features.shape[0], dtype=np.int64)
        table = np.asarray(r.pages, dtype=np.int64)
        positions.append(pos)
        slots.append(table[pos // size] * size + pos % size)
    features = torch.cat([r.features for r in rows])
    runner.write_draft_context(features, np.concatenate(positions), np.concatenate(slots))


def draft_blocks(
    runner: DraftRunner,
    anchors: torch.Tensor,  # [R] int64 on the device: each request's newest token
    starts: np.ndarray,  # [R] the anchor's position (= tokens with target K/V)
    page_tables: list[list[int]],
    block_size: int,
    mask_token_id: int,
) -> torch.Tensor:
    """Drafts [R, B-1]: each block sees the request's whole draft context and itself."""
    num_req = anchors.shape[0]
    block = torch.full(
        (num_req, block_size), mask_token_id, dtype=torch.long, device=anchors.device
    )
    block[:, 0] = anchors
    widths = np.full(num_req, block_size, dtype=np.int64)
    host = host_meta(starts, widths, page_tables, runner.page_size)
    return runner.draft_block(block.view(-1), host)
