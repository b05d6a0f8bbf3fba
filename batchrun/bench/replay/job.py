"""Whole jobs replayed on the CPU through the engine's own width logic: the real Scheduler
(schedule, update_from_output) and the real DFlashSpeculator (next_widths, admit,
learn, writes_context, over its WidthPolicy), stepped in the engine's order (the next step is
chosen and launched before the last one is read back). No model runs: each step's time comes from
a cost model that charges the drafter's work (its forward at a drafting width, timed on its own
as the draft clock times it, its context writes at width 1 and in prefill chunks): the H200 at
the Qwen3-8B shape, or the demo pair on this project's 2-core CPU. Each round's acceptance is
drawn from the scenario's chance per draft, which may change per row and over a row's output."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from batchrun.bench.replay.costs import Costs, H200Costs
from batchrun.bench.replay.graphs import StepGraphs
from batchrun.bench.replay.step import BLOCK, ReplayStep
from batchrun.engine.core.page_pool import PagePool
from batchrun.engine.core.requests import Request
from batchrun.engine.core.scheduler import Scheduler
from batchrun.engine.core.step import ScheduledStep, StepOutput
from batchrun.engine.core.stopping import Stopper
from batchrun.engine.cuda_graphs import ladder_bucket
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.base import Speculator
from batchrun.spec_decode.dflash.inputs import DraftContext
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from batchrun.spec_decode.width_policy import candidate_widths

H200 = H200Costs()  # the default cost model
TOKEN = 7  # every sampled token (no stop token: rows end at max_tokens)

# accept(row, position): each draft's chance to be accepted (given the ones before) in a round
# of `row` whose output holds `position` tokens.
Acceptance = Callable[[int, int], float]


@dataclass(frozen=True)
class Job:
    rows: int
    prompt_len: int
    max_tokens: int
    batch: int
    budget: int = 4096
    prefill_beside_decode: int | None = None  # the engine's option of that name
    constrained: bool = False  # every row's mask is built (its cost counted)
    oracle: bool = False  # the drafts are bench/oracle.py's (its work counted)


@dataclass
class Replay:
    seconds: float = 0.0
    tokens: int = 0
    widths: Counter[int] = field(default_factory=Counter)  # decoding steps per width
    trace: list[int] = field(default_factory=list)  # every decoding step's width, in order
    steps: list[tuple[ReplayStep, float]] = field(default_factory=list)  # each, with its ms

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


class CostClock:
    """The draft clock of draft_clock.py, reading the cost model's draft time."""

    def __init__(self, costs: Costs) -> None:
        self.costs = costs

    def take_ms(self, step: ReplayStep) -> float | None:
        return self.costs.draft(step) if step.drafting else None

    def clear(self) -> None:
        pass


def speculator(widths: tuple[int, ...], job: Job, costs: Costs = H200) -> Speculator:
    """The DFlash speculator's width logic without a model (its policy, admissions and step
    bookkeeping run; nothing is drafted); plain decoding for widths (1,) without a draft."""
    spec = DFlashSpeculator.__new__(DFlashSpeculator)
    Speculator.__init__(spec)
    spec.target = SimpleNamespace(graphs=SimpleNamespace(bucket=ladder_bucket))  # type: ignore[assignment]
    spec.tp, spec.block_size, spec.widths = None, BLOCK, widths
    spec.clock = CostClock(costs)  # type: ignore[assignment]
    spec.context = DraftContext.zeros(job.batch + 1, torch.device("cpu"))
    spec.start_job(job.batch, job.budget)
    return spec


def replay(
    job: Job,
    accept: Acceptance | None,
    width: int | str = "auto",
    costs: Costs = H200,
    seed: int = 0,
) -> Replay:
    """The job with no draft (accept None) or with the draft at `width` (auto, or a fixed
    width: the engine's `verify_width`)."""
    if accept is None:
        spec, decode_width, min_width = Speculator(), 1, 1
    else:
        widths = candidate_widths(BLOCK) if width == "auto" else (int(width),)
        spec, decode_width, min_width = speculator(widths, job, costs), BLOCK, widths[0]
    pages = job.rows * (job.prompt_len + job.max_tokens + 3 * BLOCK) // 16 + job.rows
    scheduler = Scheduler(
        PagePool(pages, 16),
        job.batch,
        job.budget,
        decode_width=decode_width,
        min_width=min_width,
        prefill_beside_decode=job.prefill_beside_decode,
    )
    params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True)
    for i in range(job.rows):
        scheduler.add(Request(i, [1] * job.prompt_len, params))
    stopper, draws, result = Stopper(None, set(), 1 << 30), Draws(seed), Replay()
    graphs = StepGraphs(job.batch, job.budget, spec.widths)
    launched: Launched | None = None
    last_width = 0
    while scheduler.num_unfinished or launched is not None:
        slots = [req.state.slot for req in scheduler.running]
        scheduled = scheduler.schedule(spec.next_widths(slots, scheduler.prefill_pending))
        new = None
        if scheduled.items:
            if scheduled.admitted:
                given = torch.tensor([it.slot for it in scheduled.admitted])
                spec.admit([it.req for it in scheduled.admitted], given)
            step = _shape(scheduled, spec, job, graphs, last_width)
            last_width = step.max_width if step.num_decoding else 0
            items = scheduled.items
            new = Launched(
                scheduled,
                step,
                accepted=[_drawn(it.req, it.num_new, accept, draws) for it in items if it.decoding],
                ms=costs.step(step),
            )
            result.seconds += new.ms / 1e3
            result.steps.append((step, new.ms))
            if step.num_decoding:
                result.widths[step.max_width] += 1
                result.trace.append(step.max_width)
        if launched is not None:
            _read_back(scheduler, spec, stopper, launched)
        launched = new
    result.tokens = job.rows * job.max_tokens
    result.seconds += costs.job_seconds(job.rows)
    return result


def _shape(
    scheduled: ScheduledStep, spec: Speculator, job: Job, graphs: StepGraphs, last_width: int
) -> ReplayStep:
    items = scheduled.items
    decoding = [it for it in items if it.decoding]
    widths = tuple(it.num_new for it in decoding)
    uniform = len(decoding) == len(items)
    target_rows = graphs.target_rows(widths) if uniform else None
    return ReplayStep(
        widths=widths,
        decode_slots=tuple(it.slot for it in decoding),
        num_live=len(items),
        prefill_rows=sum(it.num_new for it in items if not it.decoding),
        context=sum(it.req.state.num_cached for it in decoding),
        writes_context=spec.writes_context or any(not it.decoding for it in items),  # as
        constrained=job.constrained,  # the runner does
        drafter=isinstance(spec, DFlashSpeculator),
        oracle=job.oracle,
        target_graph_rows=target_rows or 0,
        draft_graph_requests=graphs.draft_requests(sum(w > 1 for w in widths)),
        switched=bool(widths) and last_width != 0 and max(widths) != last_width,
    )


class Draws:
    """One uniform number per (row, output position), the same in every replay of a seed: a
    draft proposing a row's token at a position is right or not whatever the width or step
    that verifies it (as a drafter's guess depends on the text, not on the schedule), so
    replays at different widths compare on the same luck."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rows: dict[int, list[float]] = {}

    def __call__(self, row: int, pos: int) -> float:
        numbers = self.rows.get(row)
        if numbers is None:
            numbers = self.rows[row] = []
        if pos >= len(numbers):
            rng = random.Random(f"{self.seed}-{row}-{len(numbers)}")
            numbers += [rng.random() for _ in range(pos + 256 - len(numbers))]
        return numbers[pos]


def _drawn(req: Request, width: int, accept: Acceptance | None, draws: Draws) -> int:
    """Drafts accepted in a round from the row's output position: draft j is right where the
    draw at its position is under the chance (at the round's start) of the scenario."""
    pos = len(req.output.token_ids)
    p = accept(req.row_index, pos) if accept is not None else 0.0
    accepted = 0
    while accepted < width - 1 and draws(req.row_index, pos + accepted) < p:
        accepted += 1
    return accepted


@dataclass(frozen=True)
class Launched:
    """A step on its way, with what the engine keeps of it until it is read back."""

    scheduled: ScheduledStep
    step: ReplayStep
    accepted: list[int]  # drafts each decoding item's round accepts
    ms: float


def _read_back(
    scheduler: Scheduler, spec: Speculator, stopper: Stopper, launched: Launched
) -> None:
    """As the engine reads a step back: the speculator learns from it, then the scheduler
    commits each request's tokens (the anchor's next token and the accepted drafts)."""
    spec.learn(launched.step, launched.accepted, launched.ms / 1e3)
    output = StepOutput(
        items=launched.scheduled.items,
        tokens=[TOKEN] * sum(it.num_sampled for it in launched.scheduled.items),
        accepted=launched.accepted,
        drafts=[],
        num_drafts=0,
    )
    scheduler.update_from_output(output, stopper=stopper)
