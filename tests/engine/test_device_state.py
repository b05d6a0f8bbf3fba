"""The device-resident batch state and the step inputs built from it: page-table entries go to
the device once, the device builds the same rows a host loop would, and the commit rule moves
lengths, anchors, counters and the draft's pending context as the engine's host view does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.core.step import Scheduled
from batchrun.engine.device_state import DeviceState
from batchrun.engine.step_inputs import StepPlan, plan_step, step_args, target_inputs
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.dflash.inputs import DraftContext

PAGE, WIDTH, SLOTS = 4, 3, 6
CPU = torch.device("cpu")


def make_request(slot: int, prompt: int, outputs: int, num_cached: int, pool: PagePool) -> Request:
    req = Request(
        row_index=slot, prompt_ids=list(range(100, 100 + prompt)), params=SamplingParams()
    )
    req.output.token_ids = list(range(500 + slot * 10, 500 + slot * 10 + outputs))
    req.state.slot, req.state.num_cached = slot, num_cached
    return req


def test_page_entries_go_to_the_device_once() -> None:
    pool = PagePool(64, PAGE)
    req = make_request(2, prompt=30, outputs=0, num_cached=0, pool=pool)
    pool.grow(req.state.pages, 9)

    def planned(num_new: int) -> StepPlan:  # as the engine does: then the pages are sent
        plan = plan_step([Scheduled.of(req, num_new, decoding=False)], SLOTS)
        req.state.pages_on_device = len(req.state.pages)
        return plan

    first = planned(9)
    assert first.num_updates == 3
    req.state.num_cached = 9
    pool.grow(req.state.pages, 12)  # within the pages it has: nothing new to send
    again = planned(3)
    assert again.num_updates == 0
    req.state.num_cached = 12
    pool.grow(req.state.pages, 16)
    grown = planned(4)
    assert grown.num_updates == 1
    args = step_args(torch.from_numpy(grown.packed), grown)
    assert args.updates[:, 0].tolist() == [2, 3, req.state.pages[3]]


def test_device_rows_equal_a_host_loop() -> None:
    """A mixed step (two requests verifying at widths of their own, a prefill chunk completing
    its prompt, a chunk in the middle of one), then the same decoding requests padded to a
    graph's requests and rows: each request's rows start where the one before it ends."""
    pool = PagePool(64, PAGE)
    state = DeviceState(SLOTS, 8, 1000, CPU)
    dec_a = make_request(0, prompt=5, outputs=3, num_cached=7, pool=pool)
    dec_b = make_request(3, prompt=2, outputs=1, num_cached=2, pool=pool)
    last = make_request(1, prompt=6, outputs=0, num_cached=4, pool=pool)
    mid = make_request(4, prompt=9, outputs=0, num_cached=0, pool=pool)
    parts = [(dec_a, WIDTH, True), (dec_b, 2, True), (last, 2, False), (mid, 5, False)]
    for req, num_new, _ in parts:  # the scheduler's pages, then its snapshots
        pool.grow(req.state.pages, req.state.num_cached + num_new)
    batch = [Scheduled.of(req, num_new, decoding=decoding) for req, num_new, decoding in parts]
    state.admit(batch)
    for it in batch:  # the device's lengths, as earlier steps would have left them
        state.seq_len[it.req.state.slot] = it.req.state.num_cached
    drafts = torch.tensor([[11, 12], [21, 22]])
    samples = [it.num_sampled for it in batch]
    assert samples == [WIDTH, 2, 1, 0]
    plan = plan_step(batch, SLOTS)
    assert (plan.widths, plan.decode_rows) == ((WIDTH, 2), WIDTH + 2)
    args = step_args(torch.from_numpy(plan.packed), plan)
    state.add_pages(args.updates)
    got = target_inputs(args, state, drafts, plan.num_rows, True, PAGE, plan.max_q, plan.max_kv)

    ids, positions, slots, steps = [], [], [], []
    for r, it in enumerate(batch):
        req = it.req
        for j in range(it.num_new):
            pos = req.state.num_cached + j
            positions.append(pos)
            slots.append(req.state.pages[pos // PAGE] * PAGE + pos % PAGE)
            if it.decoding:
                ids.append(req.output.token_ids[-1] if j == 0 else int(drafts[r, j - 1]))
            else:
                ids.append(req.token_slice(pos, pos + 1)[0])
            steps.append(len(req.output.token_ids) + j - (it.num_new - samples[r]))
    assert got.ids.tolist() == ids
    assert got.meta.positions.tolist() == positions
    assert got.meta.kv_index.tolist() == slots
    assert got.meta.cu_q.tolist() == [0, 3, 5, 7, 12]
    assert got.meta.kv_lens.tolist() == [10, 4, 6, 5]
    assert args.logit_rows is not None and args.logit_rows.tolist() == [0, 1, 2, 3, 4, 6]
    rows = args.logit_rows
    assert got.row_step[rows].tolist() == [steps[i] for i in rows.tolist()]
    assert got.row_slot[rows].tolist() == [0, 0, 0, 3, 3, 1]
    assert got.context_kv_index.tolist() == [-1] * 5 + slots[5:]

    # The decoding pair alone, padded to a graph of 4 requests and 8 rows: padding rows write
    # nothing.
    pad = plan_step(batch[:2], SLOTS, pad_to=(4, 8))
    args = step_args(torch.from_numpy(pad.packed), pad)
    padded = target_inputs(args, state, drafts, pad.num_rows, True, PAGE, WIDTH, 64)
    assert pad.uniform and pad.num_rows == 8
    assert padded.ids[:5].tolist() == ids[:5]
    assert padded.meta.kv_index.tolist() == slots[:5] + [-1] * 3
    assert padded.meta.cu_q.tolist() == [0, 3, 5, 5, 5]
    assert padded.row_slot[5:].tolist() == [SLOTS] * 3


def test_commit_moves_the_state_like_the_host() -> None:
    state = DeviceState(SLOTS, 8, 1000, CPU)
    state.seq_len[torch.tensor([5, 2, 0])] = torch.tensor([20, 9, 4])
    state.out_len[torch.tensor([5, 2, 0])] = torch.tensor([7, 3, 0])
    state.last_token[0] = 99
    # Two requests verifying at widths of their own, then a chunk completing a prompt.
    slots = torch.tensor([5, 2, 0])
    q_lens = torch.tensor([WIDTH, 2, 4])
    sampled = torch.tensor([WIDTH, 2, 1])
    tokens = torch.tensor([31, 32, 33, 41, 42, 51])
    accepted = torch.tensor([2, 0])
    state.commit(slots, q_lens, sampled, tokens, accepted, 2, decode_rows=5, max_width=WIDTH)
    assert state.seq_len[slots].tolist() == [23, 10, 8]
    assert state.out_len[slots].tolist() == [10, 4, 1]
    assert state.last_token[slots].tolist() == [33, 41, 51]


def test_a_verify_leaves_its_kept_rows_for_the_draft_context() -> None:
    context = DraftContext.zeros(SLOTS + 1, CPU)
    slots = torch.tensor([5, 2])  # two verifying requests: 2 drafts accepted, then none
    context.commit(slots, torch.tensor([2, 0]), torch.tensor([WIDTH, 2]), drafted=True)
    assert context.rows[slots].tolist() == [3, 1] and context.rows[0].item() == 0
    assert context.row0[slots].tolist() == [0, WIDTH]
    # A later step that leaves slot 5 out: its context rows are no longer pending.
    context.commit(slots[1:2], torch.tensor([0]), torch.tensor([2]), drafted=True)
    assert context.rows[5].item() == 0
    context.admit(torch.tensor([2]))  # a slot taken afresh: nothing of it waits
    assert context.rows[2].item() == 0


def test_a_new_slot_starts_from_the_request() -> None:
    state = DeviceState(SLOTS, 8, 1000, CPU)
    state.seq_len[3] = 50
    req = Request(
        row_index=0, prompt_ids=[1, 2], params=SamplingParams(temperature=0.5, top_k=5000, seed=-1)
    )
    req.output.token_ids, req.state.slot = [7, 8], 3
    state.admit([Scheduled.of(req, 1, decoding=False)])
    assert state.seq_len[3].item() == 0
    assert (state.out_len[3].item(), state.last_token[3].item()) == (2, 8)
    sampling = state.sampling.tables
    assert sampling["top_k"][3].item() == 0  # at least the vocabulary: off
    assert sampling["seed"][3].item() == -1 and np.isclose(sampling["temperature"][3].item(), 0.5)


def test_the_next_step_is_launched_before_this_one_is_read(tiny_model: Path) -> None:
    """In the steady state every decoding request has one step on the device that the host
    has not read: its host length lags the device's by that step, and the outputs are those of
    a plain loop (the oracle tests) with nothing lost at the end."""
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine

    engine = Engine(EngineConfig(target=tiny_model, device="cpu", max_batch_size=4, num_pages=64))
    reqs = [Request(i, [5, 6, 7, 8 + i], SamplingParams(max_tokens=12)) for i in range(3)]
    for req in reqs:
        engine.add(req)
    for _ in range(4):
        engine.step()
    state = engine.runner.state
    for req in reqs:
        assert req.state.in_flight == 1
        assert state.seq_len[req.state.slot].item() == req.state.num_cached + 1
        assert state.out_len[req.state.slot].item() == len(req.output.token_ids) + 1
    while engine.num_unfinished:
        engine.step()
    assert [len(r.output.token_ids) for r in reqs] == [12, 12, 12]
    assert engine.pool.num_free == 64
    assert engine.info()["cuda_graphs"] is False  # a CPU: no graphs


def test_the_memory_sizing_counts_what_a_slot_allocates() -> None:
    """The batch footprint's bytes per slot (beside the page-table row) are those the per-slot
    tensors take: the device state's, its sampling tables' (from their one declaration) and a
    draft's context."""
    from batchrun.engine.memory import PER_SLOT_BYTES

    max_pages = 8
    state = DeviceState(SLOTS, max_pages, 1000, CPU)
    tensors = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    tensors += [*state.sampling.tables.values(), *vars(DraftContext.zeros(SLOTS + 1, CPU)).values()]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == (SLOTS + 1) * (4 * max_pages + PER_SLOT_BYTES)
