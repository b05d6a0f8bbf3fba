"""DFlash drafting for a step: every request's newly committed target features go into the
draft's context cache, then one block (anchor + B-1 masks) is drafted per request about to
verify, in one draft forward.

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

    def draft_forward(
        self,
        features: torch.Tensor,
        ctx_positions: np.ndarray,
        ctx_slots: np.ndarray,
        block_ids: torch.Tensor,
        host: HostMeta,
    ) -> torch.Tensor: ...


@dataclass
class ContextRows:
    """One request's new context rows: target features of tokens start .. start + n - 1."""

    features: torch.Tensor  # [n, layers * H]
    start: int
    pages: list[int]


@dataclass
class Blocks:
    """The requests to draft for: each one's newest token (the anchor) and its position."""

    anchors: list[int]
    starts: list[int]  # the anchor's position (= tokens with target K/V)
    page_tables: list[list[int]]


def propose(
    runner: DraftRunner,
    context: list[ContextRows],
    blocks: Blocks,
    block_size: int,
    mask_token_id: int,
) -> torch.Tensor | None:
    """Store the context rows' draft K/V; return the drafts [R, B-1] of every block (each
    sees its request's whole draft context and itself), or None when there is no block."""
    features, positions, slots = _context_arrays(runner, context)
    if not blocks.anchors:
        runner.write_draft_context(features, positions, slots)
        return None
    num_req = len(blocks.anchors)
    block = torch.full((num_req, block_size), mask_token_id, dtype=torch.long)
    block[:, 0] = torch.tensor(blocks.anchors, dtype=torch.long)
    widths = np.full(num_req, block_size, dtype=np.int64)
    host = host_meta(np.array(blocks.starts), widths, blocks.page_tables, runner.page_size)
    block_ids = block.view(-1).to(runner.device, non_blocking=True)
    return runner.draft_forward(features, positions, slots, block_ids, host)


def _context_arrays(
    runner: DraftRunner, context: list[ContextRows]
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The rows' features (one tensor), positions and draft-cache slots."""
    if not context:
        empty = np.zeros(0, dtype=np.int64)
        return torch.zeros(0, device=runner.device), empty, empty
    starts = np.array([r.start for r in context], dtype=np.int64)
    counts = np.array([r.features.shape[0] for r in context], dtype=np.int64)
    rows = host_meta(starts, counts, [r.pages for r in context], runner.page_size)
    features = torch.cat([r.features for r in context])
    return features, rows.positions, rows.slot_mapping
