"""The ring of pages that holds a sliding-window DFlash draft layer's context K/V (how its
block rows attend: models/block_attention.py).

A sliding layer's row at position q sees only positions > q - W (flash-attention's window of W
positions, the row's own included), so a block anchored at p reads positions p - W + 1 ..
p + B - 1 and nothing older, ever again. Its cache is therefore a fixed ring of R pages per
request slot, R * page_size >= W + B - 1: position i lives in ring page (i // page_size) % R of
its slot. The ring is addressed through a static page table whose column j points at the
slot's ring page j mod R, so the attention kernels, which index page_table[i // page_size],
need only the window mask. A sliding layer's memory is bounded by construction (slots x R
pages) and released as the window moves, because it is overwritten in place.

Positions map to the ring modulo its capacity, so no alignment slack is needed: a block writes
its own rows p .. p + B - 1 (overwriting positions at most p + B - 1 - capacity < p - W + 1, which
no later block reads) and committed context rows only ever move forward.
"""

from __future__ import annotations

import torch


def ring_positions(window: int, block_size: int) -> int:
    """The W + B - 1 positions a block reads."""
    return window + block_size - 1


def ring_pages(window: int, block_size: int, page_size: int) -> int:
    """R: pages per slot that hold the positions a block reads."""
    return -(-ring_positions(window, block_size) // page_size)


class DraftRing:
    """The ring pages of every request slot (and the scratch slot graph padding points at)."""

    def __init__(
        self,
        num_slots: int,
        max_pages: int,
        window: int,
        block_size: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.pages_per_slot = ring_pages(window, block_size, page_size)
        self.capacity = self.pages_per_slot * page_size  # positions a slot's ring holds
        self.num_pages = (num_slots + 1) * self.pages_per_slot
        slots = torch.arange(num_slots + 1, device=device)[:, None]
        columns = torch.arange(max_pages, device=device)[None, :]
        # [slots + 1, max_pages]: column j of a slot's row is its ring page j mod R.
        self.table = (slots * self.pages_per_slot + columns % self.pages_per_slot).to(torch.int32)

    def kv_index(
        self,
        slot: torch.Tensor,  # [T] the request slot of each row
        positions: torch.Tensor,  # [T]
        end: torch.Tensor,  # [T] one past the last position its request writes in this write
        keep: torch.Tensor,  # [T] bool: rows to store at all
    ) -> torch.Tensor:
        """The ring's cache index of each row to store (-1: none). A row that a later row of
        the same request in the same write would overwrite (a prefill chunk longer than the
        ring) is left out, so no two rows of one write share a place."""
        page = self.table[slot, torch.div(positions, self.page_size, rounding_mode="floor")]
        ring = page.long() * self.page_size + positions % self.page_size
        return torch.where(keep & (positions >= end - self.capacity), ring, -1)
