"""The seam between the scheduler and the worker: a scheduled step is a snapshot of what its plan
needs, taken before the scheduler marks it launched (the plan reads no request state), and the
worker runs steps from it alone: stepped one at a time, each read back before the next is
scheduled, it samples what the overlapped engine samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.core.scheduler import Scheduler
from batchrun.engine.core.step import StepOutput
from batchrun.engine.core.stopping import Stopper
from batchrun.engine.step_inputs import plan_step
from batchrun.sampling.params import SamplingParams
from tests.helpers.engine_runs import cpu_engine, run_to_end

SLOTS = 4


def test_a_scheduled_step_is_a_snapshot_taken_before_its_launch() -> None:
    pool = PagePool(32, 4)
    scheduler = Scheduler(pool, SLOTS, 64, decode_width=4)
    req = Request(0, list(range(3, 13)), SamplingParams(max_tokens=8))
    scheduler.add(req)
    step = scheduler.schedule()
    [chunk] = step.items
    assert step.admitted == [chunk]
    assert (chunk.slot, chunk.start, chunk.num_new, chunk.num_sampled) == (0, 0, 10, 1)
    assert chunk.chunk_ids == req.prompt_ids
    assert (chunk.first_new_page, chunk.new_pages) == (0, req.state.pages)
    # Launched as it was scheduled: the state moved on, the snapshot did not.
    assert req.state.num_cached == 10 and req.state.pages_on_device == len(req.state.pages)
    plan = plan_step(step.items, SLOTS)
    req.state.num_cached, req.state.slot, req.state.pages = 99, 3, []
    assert np.array_equal(plan_step(step.items, SLOTS).packed, plan.packed)
    req.state.num_cached, req.state.slot, req.state.pages = 10, 0, chunk.new_pages

    stopper = Stopper(None, set(), 1 << 30)
    output = StepOutput(step.items, tokens=[7], accepted=[], drafts=[], num_drafts=0)
    scheduler.update_from_output(output, stopper=stopper)
    [verify] = scheduler.schedule(4).items  # 10 + 4 rows: a fourth page
    assert (verify.decoding, verify.start, verify.num_sampled) == (True, 10, 4)
    assert (verify.first_new_page, verify.new_pages) == (3, req.state.pages[3:])
    [after] = scheduler.schedule(4).items  # before the verify is read: its rows count whole
    assert (after.start, req.state.in_flight) == (14, 8)


def test_the_worker_stepped_alone_samples_what_the_overlapped_engine_does(
    tiny_model: Path,
) -> None:
    def requests() -> list[Request]:
        return [
            Request(
                i,
                [5, 6, 7, 8 + i] * (i + 1),
                SamplingParams(max_tokens=10, temperature=0.8, seed=i),
            )
            for i in range(3)
        ]

    engine = cpu_engine(tiny_model, None, max_batch_size=SLOTS, num_pages=64)
    overlapped = run_to_end(engine, requests())
    engine.new_job()
    scheduler, worker = engine.scheduler, engine.worker
    alone = requests()
    for req in alone:
        scheduler.add(req)
    while scheduler.num_unfinished:
        slots = [req.state.slot for req in scheduler.running]
        widths = worker.next_widths(slots, scheduler.prefill_pending)
        forward = worker.launch_forward(scheduler.schedule(widths))
        output = worker.read(worker.launch_sampling(forward, None))
        scheduler.update_from_output(output, stopper=engine.stopper)
    assert [r.output.token_ids for r in alone] == [r.output.token_ids for r in overlapped]
    assert all(len(r.output.token_ids) == 10 for r in alone)
