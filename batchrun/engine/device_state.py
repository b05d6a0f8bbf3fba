"""Per-request state that lives on the device across steps, one slot per running request.

The scheduler hands out slots as it hands out pages; a request keeps its slot until it
finishes or is preempted. What a step needs about a request is read here on the device: its
page table, how many tokens hold target KV (seq_len), its newest token (the next anchor), how
many output tokens it has (the sampler's counter) and, in `sampling`, its sampling parameters and
logit controls (sampling/slot_tables.py). The host sends only what changes: a new request's row
once, new pages as (slot, column, page) triples, and the step's own rows (engine/step_inputs.py).
Every step's commit then updates the state on the device (`commit`), so the next step can be
launched before the host has read this one's tokens.

Slot `num_slots` is scratch: padded requests of a CUDA graph point at it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchrun.attention.meta import padded_rows, row_starts
from batchrun.device import put
from batchrun.engine.core.step import Scheduled
from batchrun.sampling.slot_tables import SAMPLING_SLOT_BYTES, SlotTables

# The int64 fields below, and the sampling tables': what a slot takes beside its page table.
DEVICE_SLOT_BYTES = 3 * 8 + SAMPLING_SLOT_BYTES


class DeviceState:
    def __init__(
        self, num_slots: int, max_pages: int, vocab_size: int, device: torch.device
    ) -> None:
        self.num_slots, self.max_pages, self.vocab_size = num_slots, max_pages, vocab_size
        self.device = device
        n = num_slots + 1

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.page_table = zeros(n, max_pages, dtype=torch.int32)
        self.seq_len = zeros(n)  # leading tokens whose target KV is written
        self.out_len = zeros(n)  # output tokens committed: the next one's sampling counter
        self.last_token = zeros(n)  # the newest token: the next decode/verify step's anchor
        self.sampling = SlotTables(num_slots, vocab_size, device)

    # -- host -> device -----------------------------------------------------------------------

    def admit(self, items: Sequence[Scheduled]) -> torch.Tensor:
        """Fill the slots of requests that just took one in the step (admitted, or resumed
        after a preemption: their KV is recomputed from the start, or from a cached prefix);
        returns those slots, on the device."""
        reqs = [it.req for it in items]
        slots = put([it.slot for it in items], torch.int64, self.device)
        self.seq_len[slots] = put([it.start for it in items], torch.int64, self.device)
        outputs = [r.output.token_ids for r in reqs]
        self.out_len[slots] = put([len(ids) for ids in outputs], torch.int64, self.device)
        last = [ids[-1] if ids else 0 for ids in outputs]
        self.last_token[slots] = put(last, torch.int64, self.device)
        self.sampling.admit(reqs, slots)
        return slots

    def add_pages(self, updates: torch.Tensor) -> None:
        """updates [3, U] on the device: slot, column, page of each new page-table entry."""
        if updates.shape[1]:
            self.page_table[updates[0], updates[1]] = updates[2].to(torch.int32)

    # -- the step's commit, on the device -----------------------------------------------------

    def commit(
        self,
        slots: torch.Tensor,  # [R] the step's requests: D decoding first, then prefill chunks
        q_lens: torch.Tensor,  # [R] their rows, packed in order
        sampled: torch.Tensor,  # [R] rows sampled per request (a verify: all; a chunk: 0 or 1)
        tokens: torch.Tensor,  # [N] the sampled tokens, in request order
        accepted: torch.Tensor,  # [D] drafts accepted per decoding request
        num_decoding: int,
        decode_rows: int,  # the decoding requests' rows in all (their tokens lead `tokens`)
        max_width: int,  # the widest decoding request's rows
    ) -> None:
        """A decoding request commits its anchor and accepted drafts (KV) and the tokens
        after them; a prefill chunk commits its rows, and a completing one its first token."""
        d = num_decoding
        keep = accepted + 1
        kv_rows = q_lens.clone()
        kv_rows[:d] = keep
        new_tokens = sampled.clone()
        new_tokens[:d] = keep
        last = self.last_token[slots]
        # Each decoding request's tokens as a [D, max_width] grid, by its rows' offsets.
        grid, _ = padded_rows(row_starts(q_lens[:d]), q_lens[:d], max_width)
        post = tokens[grid] if d else tokens.new_zeros(0, max_width)
        if d:
            last[:d] = post.gather(1, accepted.view(-1, 1)).view(-1)
        # A completing chunk's token: the j-th sampled chunk samples tokens[decode_rows + j].
        chunk_sampled = sampled > 0
        chunk_sampled[:d] = False
        index = (decode_rows + chunk_sampled.cumsum(0) - 1).clamp(0, max(tokens.shape[0] - 1, 0))
        chunk_token = tokens[index] if tokens.shape[0] else last
        last = torch.where(chunk_sampled, chunk_token, last)
        self.sampling.controls.commit(slots, post, accepted, chunk_token, chunk_sampled)
        self.seq_len.index_add_(0, slots, kv_rows)
        self.out_len.index_add_(0, slots, new_tokens)
        self.last_token.index_copy_(0, slots, last)
