"""The step contract: what the scheduler decides for one step (`ScheduledStep`, as vLLM's
SchedulerOutput), and what the host reads back of it (`StepOutput`), which the scheduler applies
in one place (core/scheduler.py's update_from_output).

A scheduled item is a snapshot: what the step's plan needs of a request (its slot, where its rows
start, their tokens, the rows it samples, its new page-table entries), taken when the scheduler
decides the step and before it marks the step launched. The request's state moves on at once;
the worker reads the snapshot, never the state, so no call order couples the two."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.core.requests import Request
from batchrun.sampling.logprobs import ReadLogprobs


@dataclass(frozen=True)
class Scheduled:
    """One request's part of a step. `req` is the scheduler's handle (the results are applied
    to it); the worker reads of it only what was asked (its params) and its output."""

    req: Request
    num_new: int  # rows this request feeds to the target in this forward (a verify: its width)
    decoding: bool  # True: a decode/verify step; False: a prefill chunk
    slot: int  # its row in the device state
    # The position of its first row as the host knows it: a chunk's exactly; a decoding item's
    # at most (its rows in flight count whole, the device knows how many it kept).
    start: int
    num_sampled: int  # rows the step samples: every verify row; a completing prompt's last row
    chunk_ids: list[int]  # a prefill chunk's tokens (a decoding item's come from the device)
    first_new_page: int  # the page-table column of new_pages[0]
    new_pages: list[int]  # the pages the device's table lacks
    epoch: int  # the request's epoch at launch: a later one drops the result
    # A hybrid target's chunk: the state snapshot its linear layers start from (a reused
    # prefix), and the one its end is stored in (core/state_snapshots.py); -1: none.
    restore: int = -1
    store: int = -1

    @classmethod
    def of(
        cls, req: Request, num_new: int, *, decoding: bool, restore: int = -1, store: int = -1
    ) -> Scheduled:
        """The snapshot of `req`'s part of a step, from its state before the step launches."""
        state, output = req.state, req.output
        start = state.num_cached + (state.in_flight if decoding else 0)
        completes = not output.token_ids and state.num_cached + num_new == len(req.prompt_ids)
        return cls(
            req=req,
            num_new=num_new,
            decoding=decoding,
            slot=state.slot,
            start=start,
            num_sampled=num_new if decoding else int(completes),
            chunk_ids=[] if decoding else req.token_slice(start, start + num_new),
            first_new_page=state.pages_on_device,
            new_pages=state.pages[state.pages_on_device :],
            epoch=state.epoch,
            restore=restore,
            store=store,
        )


@dataclass(frozen=True)
class ScheduledStep:
    """One step, as the scheduler returns it (already marked launched). Decoding items come
    first (oldest first), then prefill chunks; `admitted` are the items of the requests given a
    slot in this step (their device state is sent once). Each decoding item verifies at its
    own width (its num_new rows: 1 is plain decoding), its rows packed after the items before
    it."""

    items: list[Scheduled]
    admitted: list[Scheduled]


@dataclass(frozen=True)
class StepOutput:
    """A launched step's results as the host read them. Invariants: tokens holds each item's
    num_sampled tokens, item after item; accepted holds one count per decoding item, drafts
    num_drafts ids per decoding item (0: not traced), of which an item verified its first
    num_new - 1."""

    items: list[Scheduled]
    tokens: list[int]
    accepted: list[int]
    drafts: list[int]
    num_drafts: int
    scores: ReadLogprobs | None = None  # the rows' log-probabilities, when the job asks
