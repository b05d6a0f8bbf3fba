"""DFlash drafting for a step, built on the device from the per-slot state: the rows the last
verify committed enter the draft's context cache, then one block (anchor + B-1 masks) is
drafted per decoding request over its draft context and the block. Full-attention layers keep
their context in the target's pages; sliding-window layers in a ring per slot
(rings.py), with an attention meta of their own.

It works on tensors (the target's SlotState, DraftContext): nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.attention.meta import AttentionMeta, kv_indices, row_starts
from batchrun.models.block_attention import BlockAttention
from batchrun.spec_decode.base import SlotState
from batchrun.spec_decode.dflash.rings import DraftRing


@dataclass(frozen=True)
class DraftContext:
    """Per slot, the rows of the last verify still to enter the draft's context: how many, and
    where they start in that verify's feature rows."""

    rows: torch.Tensor
    row0: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, device: torch.device) -> DraftContext:
        def zeros() -> torch.Tensor:
            return torch.zeros(num_slots, dtype=torch.int64, device=device)

        return cls(zeros(), zeros())

    def admit(self, slots: torch.Tensor) -> None:
        """Slots that just took a request: nothing of theirs waits."""
        self.rows[slots] = 0

    def commit(
        self, slots: torch.Tensor, accepted: torch.Tensor, widths: torch.Tensor, drafted: bool
    ) -> bool:
        """After a step: only its verify rows wait, `accepted + 1` for each decoding request in
        `slots`, starting at the request's first row of the step (its rows packed after those
        of the requests before it, widths [D] each), when the step drafted (else its rows were
        stored as it ran). Returns whether any row waits (known on the host)."""
        self.rows.zero_()
        waiting = slots.shape[0] > 0 and drafted
        if waiting:
            self.rows.index_copy_(0, slots, accepted + 1)
            self.row0.index_copy_(0, slots, row_starts(widths))
        return waiting


def context_feature_rows(
    context: DraftContext, slots: torch.Tensor, width: int, num_feature_rows: int
) -> torch.Tensor:
    """[D * W]: the row of the last step's features each context row reads (clamped: rows
    past a request's count are read but not written)."""
    j = torch.arange(width, device=slots.device)
    rows = context.row0[slots][:, None] + j
    return rows.clamp_(0, max(num_feature_rows - 1, 0)).view(-1)


@dataclass(frozen=True)
class DraftInputs:
    block_ids: torch.Tensor  # [D * W] anchor, then masks
    meta: AttentionMeta  # the blocks, for the full-attention layers
    ctx_positions: torch.Tensor  # [D * W]
    ctx_kv_index: torch.Tensor  # [D * W], -1: not a committed row
    # The sliding layers' blocks (windowed, over the ring) and context slots in the ring.
    window_meta: AttentionMeta | None = None
    ctx_window_kv_index: torch.Tensor | None = None


def draft_inputs(
    state: SlotState,
    context: DraftContext,
    slots: torch.Tensor,  # [D] the decoding requests' slots (padding: the scratch slot)
    width: int,
    mask_token_id: int,
    page_size: int,
    max_kv: int,
    attention: BlockAttention,
    ring: DraftRing | None = None,
) -> DraftInputs:
    """The draft's context rows and blocks, with no host sync (captured in CUDA graphs); the
    sliding layers' inputs when the draft has a ring for them."""
    device = slots.device
    num_req = slots.shape[0]
    live = slots != state.num_slots
    j = torch.arange(width, device=device)
    req = torch.arange(num_req, device=device)[:, None].expand(num_req, width).reshape(-1)
    start = state.seq_len[slots]
    table = state.page_table[slots]
    count = context.rows[slots]
    ctx_pos = ((start - count)[:, None] + j).clamp_(min=0).view(-1)
    committed = ((j < count[:, None]) & live[:, None]).view(-1)
    ctx_kv_index = torch.where(committed, kv_indices(table, req, ctx_pos, page_size), -1)
    block_pos = (start[:, None] + j).view(-1)
    block_kv_index = torch.where(live[req], kv_indices(table, req, block_pos, page_size), -1)
    anchor = state.last_token[slots][:, None]
    block_ids = torch.where(j == 0, anchor, mask_token_id).view(-1)
    q_lens = torch.where(live, width, 0)
    cu_q = torch.zeros(num_req + 1, dtype=torch.int32, device=device)
    cu_q[1:] = q_lens.cumsum(0)
    kv_lens = (start + q_lens).to(torch.int32)
    meta = AttentionMeta(
        positions=block_pos,
        kv_index=block_kv_index,
        cu_q=cu_q,
        kv_lens=kv_lens,
        page_table=table,
        page_size=page_size,
        max_q=width,
        max_kv=max_kv,
        causal=attention.full_causal,
    )
    if ring is None:
        return DraftInputs(block_ids, meta, ctx_pos, ctx_kv_index)
    slot_of_row = slots[req]
    window_meta = AttentionMeta(
        positions=block_pos,
        kv_index=ring.kv_index(slot_of_row, block_pos, start[req] + width, live[req]),
        cu_q=cu_q,
        kv_lens=kv_lens,
        page_table=ring.table[slots],
        page_size=page_size,
        max_q=width,
        max_kv=max_kv,
        causal=attention.sliding_causal,
        window=attention.window,
    )
    ctx_window = ring.kv_index(slot_of_row, ctx_pos, start[req], committed)
    return DraftInputs(block_ids, meta, ctx_pos, ctx_kv_index, window_meta, ctx_window)
