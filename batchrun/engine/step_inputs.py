"""One step's inputs: what the host sends (a handful of ints per request, new page-table
entries, the prompt tokens of prefill chunks) and what the device builds from it and the
per-slot state (engine/device_state.py): input ids, positions, cache indices, the attention
metadata and each row's sampling slot and counter.

The step's requests come in scheduler order, decoding ones first, each request's rows after
those of the requests before it (cumulative query lengths, as attention's cu_q): decoding
request r feeds W_r rows (its anchor, then W_r - 1 drafts; W_r is its own verify width, 1 for
plain decoding) and samples all of them; prefill chunks follow and sample only the row that
completes a fresh prompt. The host packs everything into one int64 array, copied to the device
in one transfer:

    [slot R | q_len R | sampled R | decoding R | page updates 3 x U | chunk ids T | logit rows N]

For a CUDA-graph step R is the graph's padded size and T its rows: padding requests sit in the
scratch slot, feed no rows and write nothing, and rows past the live ones are padding. A graph
reads only the request fields (`graph_step_args`), as every step it replays is uniform: no
chunk ids, and every row sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchrun.attention.meta import AttentionMeta, kv_indices
from batchrun.engine.core.step import Scheduled
from batchrun.engine.device_state import DeviceState

REQUEST_FIELDS = 4  # slot, q_len, sampled, decoding
IN_FLIGHT_STEPS = 2  # a request's pages cover the step being read back and the one launched


def step_in_size(max_batch_size: int, max_batched_tokens: int, max_pages: int) -> int:
    """The packed step's largest size: request fields, the page-table entries a step can add
    (a request admitted onto a cached prefix receives a whole table at once, and each entry is
    sent once), chunk ids and logit rows."""
    fields = REQUEST_FIELDS * max_batch_size
    return fields + 3 * max_batch_size * max_pages + 2 * max_batched_tokens


@dataclass(frozen=True)
class StepPlan:
    """The host's side of a step, built per request (never per token in Python)."""

    packed: np.ndarray  # int64, the layout above
    widths: tuple[int, ...]  # W_r of each decoding request, in step order
    decode_slots: tuple[int, ...]  # the slot of each decoding request
    num_requests: int  # R, padded for a graph step
    num_live: int  # requests actually scheduled
    num_decoding: int  # D
    num_updates: int  # U
    num_rows: int  # T (padded for a graph step)
    num_logit_rows: int  # N: the rows whose logits are taken (the logit-row section's length)
    every_row_sampled: bool  # no logit-row section: every row's logits (a verify step's)
    max_q: int
    max_kv: int  # an upper bound: the device holds the exact lengths
    chunk_lens: tuple[int, ...] = ()  # each prefill chunk's rows, in step order
    chunk_fresh: tuple[bool, ...] = ()  # each chunk starts at its request's position 0
    # A hybrid target's state snapshots (core/state_snapshots.py): (snapshot, slot) copied
    # before the forward, (slot, snapshot) after it.
    restores: tuple[tuple[int, int], ...] = ()
    stores: tuple[tuple[int, int], ...] = ()

    @property
    def max_width(self) -> int:
        """The widest decoding request's rows (1 without any: nothing is verified)."""
        return max(self.widths, default=1)

    @property
    def decode_rows(self) -> int:
        """The decoding requests' rows, which lead the step."""
        return sum(self.widths)

    @property
    def drafting(self) -> bool:
        """Some decoding request verifies drafts (those above width 1 are drafted for)."""
        return self.max_width > 1

    @property
    def uniform(self) -> bool:
        """Every live request decodes (the shape CUDA graphs are captured for)."""
        return self.num_decoding == self.num_live > 0

    @property
    def kind(self) -> str:
        """decode (every request decodes), mixed (with prefill chunks) or prefill (only them)."""
        return "decode" if self.uniform else "mixed" if self.num_decoding else "prefill"


def plan_step(
    batch: list[Scheduled],
    scratch_slot: int,
    pad_to: tuple[int, int] | None = None,
) -> StepPlan:
    """Packs the step from the scheduler's snapshots (core/step.py), with the page-table
    entries each request gained since its last step. pad_to: the graph's requests and rows to
    pad a uniform step to."""
    live = len(batch)
    num_req = pad_to[0] if pad_to is not None else live
    head = np.zeros((REQUEST_FIELDS, num_req), dtype=np.int64)
    head[0] = scratch_slot
    updates: list[np.ndarray] = []
    chunks: list[list[int]] = []
    fresh: list[bool] = []
    restores: list[tuple[int, int]] = []
    stores: list[tuple[int, int]] = []
    logit_rows: list[np.ndarray] = []
    widths: list[int] = []
    decode_slots: list[int] = []
    row = max_kv = 0
    for r, it in enumerate(batch):
        k = it.num_sampled
        head[:, r] = (it.slot, it.num_new, k, it.decoding)
        updates.append(_new_pages(it))
        max_kv = max(max_kv, it.start + it.num_new)
        if it.decoding:
            widths.append(it.num_new)
            decode_slots.append(it.slot)
        else:
            chunks.append(it.chunk_ids)
            fresh.append(it.start == 0)
            if it.restore >= 0:
                restores.append((it.restore, it.slot))
            if it.store >= 0:
                stores.append((it.slot, it.store))
        logit_rows.append(np.arange(row + it.num_new - k, row + it.num_new))
        row += it.num_new
    update = np.concatenate(updates, axis=1) if updates else np.zeros((3, 0), np.int64)
    num_rows = pad_to[1] if pad_to is not None else row
    parts = [head.reshape(-1), update.reshape(-1)]
    ids = np.zeros(row - sum(widths), dtype=np.int64)
    if chunks:
        ids[:] = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
    parts.append(ids)
    sampled_rows = np.concatenate(logit_rows) if logit_rows else np.zeros(0, np.int64)
    all_rows = len(sampled_rows) == row
    if not all_rows:
        parts.append(sampled_rows)
    return StepPlan(
        packed=np.concatenate(parts),
        widths=tuple(widths),
        decode_slots=tuple(decode_slots),
        num_requests=num_req,
        num_live=live,
        num_decoding=len(widths),
        num_updates=update.shape[1],
        num_rows=num_rows,
        num_logit_rows=len(sampled_rows),
        every_row_sampled=all_rows,
        max_q=max((it.num_new for it in batch), default=0),
        max_kv=max_kv,
        chunk_lens=tuple(len(c) for c in chunks),
        chunk_fresh=tuple(fresh),
        restores=tuple(restores),
        stores=tuple(stores),
    )


def _new_pages(it: Scheduled) -> np.ndarray:
    """(slot, column, page) of the pages the device's table lacks."""
    first, pages = it.first_new_page, it.new_pages
    out = np.empty((3, len(pages)), dtype=np.int64)
    out[0], out[1], out[2] = it.slot, np.arange(first, first + len(pages)), pages
    return out


@dataclass(frozen=True)
class StepArgs:
    """Views of the packed step on the device."""

    slot: torch.Tensor  # [R]
    q_len: torch.Tensor  # [R]
    sampled: torch.Tensor  # [R]
    decoding: torch.Tensor  # [R] 0/1
    updates: torch.Tensor  # [3, U]
    chunk_ids: torch.Tensor  # [T - the decoding requests' rows]
    logit_rows: torch.Tensor | None  # [N], None: every row


def step_args(packed: torch.Tensor, plan: StepPlan) -> StepArgs:
    r, u = plan.num_requests, plan.num_updates
    head = packed[: REQUEST_FIELDS * r].view(REQUEST_FIELDS, r)
    at = REQUEST_FIELDS * r + 3 * u
    chunk = plan.num_rows - plan.decode_rows if not plan.uniform else 0
    # A prefill step whose chunks complete no prompt samples nothing: an empty section, not
    # every row (4,096 rows of a 248k vocabulary's float logits would take 3.8 GiB).
    logit = (
        None if plan.every_row_sampled else packed[at + chunk : at + chunk + plan.num_logit_rows]
    )
    return StepArgs(
        slot=head[0],
        q_len=head[1],
        sampled=head[2],
        decoding=head[3],
        updates=packed[REQUEST_FIELDS * r : at].view(3, u),
        chunk_ids=packed[at : at + chunk],
        logit_rows=logit,
    )


def graph_step_args(packed: torch.Tensor, size: int) -> StepArgs:
    """A graph step's args: the request fields of `size` requests, nothing else."""
    head = packed[: REQUEST_FIELDS * size].view(REQUEST_FIELDS, size)
    empty = packed[:0]
    return StepArgs(head[0], head[1], head[2], head[3], empty.view(3, 0), empty, None)


def pad_graph_step(packed: torch.Tensor, size: int, scratch_slot: int) -> None:
    """`size` padding requests in the scratch slot (the step graphs are captured in)."""
    head = packed[: REQUEST_FIELDS * size].view(REQUEST_FIELDS, size)
    head.zero_()
    head[0] = scratch_slot


@dataclass(frozen=True)
class TargetInputs:
    ids: torch.Tensor  # [T]
    meta: AttentionMeta
    row_slot: torch.Tensor  # [T] the slot that samples each row (padding: the scratch slot)
    row_step: torch.Tensor  # [T] the output-token index each row would sample
    row_req: torch.Tensor  # [T] the request each row belongs to
    # [T] the cache index of each row whose draft context the step stores at once (prefill-chunk
    # rows; in a step that drafts nothing, every row: all are committed), -1 elsewhere
    context_kv_index: torch.Tensor


@dataclass(frozen=True)
class MixedDecoding:
    """The decoding part of a step that also has prefill chunks, known on the host."""

    requests: int  # D
    rows: int  # their rows in all
    max_q: int  # the widest one's


def target_inputs(
    args: StepArgs,
    state: DeviceState,
    drafts: torch.Tensor | None,  # [>= D, >= W_r - 1] this step's drafts (None: none)
    num_rows: int,
    drafting: bool,
    page_size: int,
    max_q: int,
    max_kv: int,
    mixed: MixedDecoding | None = None,
) -> TargetInputs:
    """Built on the device from the step's args and the slots' state, with no host sync:
    captured inside the CUDA graphs of decode/verify steps. Each request's rows start at its
    cumulative offset (cu_q), whatever their count. drafting: some request verifies drafts (the
    decoding rows' context then waits for acceptance); mixed: the decoding part of a step that
    also has prefill chunks (None otherwise)."""
    device = args.slot.device
    num_req = args.slot.shape[0]
    cu_q = torch.zeros(num_req + 1, dtype=torch.int64, device=device)
    torch.cumsum(args.q_len, 0, out=cu_q[1:])
    start = state.seq_len[args.slot]
    rows = torch.arange(num_rows, device=device)
    req = torch.searchsorted(cu_q[1:], rows, right=True).clamp_(max=max(num_req - 1, 0))
    live = rows < cu_q[-1]
    offset = rows - cu_q[req]
    positions = torch.where(live, start[req] + offset, 0)
    table = state.page_table[args.slot]
    kv_index = torch.where(live, kv_indices(table, req, positions, page_size), -1)
    decoding = (args.decoding[req] > 0) & live
    anchor = state.last_token[args.slot[req]]
    chunk_rows = live & ~decoding
    # Chunk rows come last: the chunk ids padded in front to the step's rows.
    ids = torch.nn.functional.pad(args.chunk_ids, (num_rows - args.chunk_ids.shape[0], 0))
    decoded = torch.where(offset == 0, anchor, 0)
    if drafts is not None and drafts.shape[1]:
        last = drafts.shape[1] - 1
        draft = drafts[req.clamp(max=drafts.shape[0] - 1), (offset - 1).clamp(0, last)]
        decoded = torch.where(offset == 0, anchor, draft)
    ids = torch.where(decoding, decoded, ids)
    row_slot = args.slot[req]
    row_step = state.out_len[row_slot] + offset - (args.q_len - args.sampled)[req]
    meta = AttentionMeta(
        positions=positions,
        kv_index=kv_index,
        cu_q=cu_q.to(torch.int32),
        kv_lens=(start + args.q_len).to(torch.int32),
        page_table=table,
        page_size=page_size,
        max_q=max_q,
        max_kv=max_kv,
        decoding=mixed.requests if mixed is not None else 0,
        decode_q=mixed.max_q if mixed is not None else 0,
        decode_rows=mixed.rows if mixed is not None else 0,
    )
    committed = chunk_rows if drafting else live
    return TargetInputs(ids, meta, row_slot, row_step, req, torch.where(committed, kv_index, -1))
