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
from typing import Protocol

import torch

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

BLOCK = 16
TOKEN = 7  # every sampled token (no stop token: rows end at max_tokens)

# accept(row, position): each draft's chance to be accepted (given the ones before) in a round
# of `row` whose output holds `position` tokens.
Acceptance = Callable[[int, int], float]


class Costs(Protocol):
    def step(self, step: ReplayStep) -> float: ...  # milliseconds, the draft's included
    def draft(self, step: ReplayStep) -> float: ...  # the draft's own forward (0: none)


@dataclass(frozen=True)
class H200Costs:
    """Milliseconds of a step: weights and K/V read (memory-bound) or its rows' matmuls
    (compute-bound), whichever is longer, plus the draft's forward over the whole block per
    drafting request, the draft's context written while the speculator writes it (10.6 against
    10.43 ms a width-1 step at batch 128 on the H200; 1.6% of a prefill row: the draft's 126M
    parameters against the target's 8B) and a constrained row's mask."""

    weights_ms: float = 4.0  # 16 GB of weights at 4 TB/s
    kv_ms_per_token: float = 0.05 / 1024  # a request's 1,024 tokens of K/V: 0.05 ms
    ms_per_row: float = 0.027  # 16 GFLOP a row at 600 TFLOP/s
    draft_ms_per_row: float = 0.0045  # 5 of 36 layers, B rows per drafting request
    draft_weights_ms: float = 0.5
    context_ms_per_request: float = 0.0013
    context_share_of_prefill: float = 0.016
    mask_ms_per_row: float = 0.004

    def draft(self, step: ReplayStep) -> float:
        if not step.drafting:
            return 0.0
        return self.draft_ms_per_row * step.num_decoding * BLOCK + self.draft_weights_ms

    def step(self, step: ReplayStep) -> float:
        d = step.num_decoding
        memory = self.weights_ms + self.kv_ms_per_token * step.context
        ms = max(memory, self.ms_per_row * step.num_rows) + self.draft(step)
        if step.writes_context:  # prompts' context is written always
            ms += self.context_ms_per_request * d * (not step.drafting)
        ms += self.ms_per_row * self.context_share_of_prefill * step.prefill_rows
        return ms + self.mask_ms_per_row * step.decode_rows * step.constrained


@dataclass(frozen=True)
class DemoCpuCosts:
    """Milliseconds of a step of the demo pair (batchrun/demo) on a 2-core CPU, fitted to the
    demo job's step times (48 rows, every width, engine/host_memory.py's allocator settings): a
    fixed part, a part per row, a part per request and token of context (the torch backend gathers
    each request's K/V once a layer: 2.8x a width-1 step over the job), the draft's forward
    over the block (its logits and its own context: 2.4 width-1 steps at first, 1.3 by the
    end) and its context writes at width 1 (5% of a step)."""

    fixed_ms: float = 6.35
    ms_per_row: float = 0.049
    ms_per_context_token: float = 0.00164
    draft_ms_per_request: float = 0.65
    draft_ms_per_context_token: float = 0.00115
    context_ms_per_request: float = 0.03
    prefill_ms_per_row: float = 0.075

    def draft(self, step: ReplayStep) -> float:
        if not step.drafting:
            return 0.0
        d = step.num_decoding
        return self.draft_ms_per_request * d + self.draft_ms_per_context_token * step.context

    def step(self, step: ReplayStep) -> float:
        d = step.num_decoding
        ms = self.fixed_ms + self.ms_per_row * step.decode_rows
        ms += self.ms_per_context_token * step.context + self.draft(step)
        ms += self.prefill_ms_per_row * step.prefill_rows
        if step.writes_context and not step.drafting:
            ms += self.context_ms_per_request * d
        return ms


@dataclass(frozen=True)
class ReplayStep:
    """A step as the speculator reads it (spec_decode/base.py's StepShape) and the cost model
    prices it."""

    widths: tuple[int, ...]  # each decoding request's verify width
    decode_slots: tuple[int, ...]  # and its slot
    num_live: int
    prefill_rows: int
    context: int  # tokens of K/V the decoding requests read
    writes_context: bool
    constrained: bool

    @property
    def num_requests(self) -> int:
        return self.num_live

    @property
    def num_decoding(self) -> int:
        return len(self.widths)

    @property
    def max_width(self) -> int:
        return max(self.widths, default=1)

    @property
    def drafting(self) -> bool:
        return self.max_width > 1

    @property
    def decode_rows(self) -> int:
        return sum(self.widths)

    @property
    def num_rows(self) -> int:
        return self.decode_rows + self.prefill_rows

    @property
    def uniform(self) -> bool:
        return self.num_decoding == self.num_live

    @property
    def max_kv(self) -> int:
        return 0


@dataclass(frozen=True)
class Job:
    rows: int
    prompt_len: int
    max_tokens: int
    batch: int
    budget: int = 4096
    constrained: bool = False  # every row's mask is built (its cost counted)

    def scaled_rows(self, rows: int) -> Job:
        return Job(
            rows, self.prompt_len, self.max_tokens, self.batch, self.budget, self.constrained
        )


@dataclass
class Replay:
    seconds: float = 0.0
    tokens: int = 0
    widths: Counter[int] = field(default_factory=Counter)  # decoding steps per width
    trace: list[int] = field(default_factory=list)  # every decoding step's width, in order

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


def speculator(widths: tuple[int, ...], job: Job, costs: Costs = H200Costs()) -> Speculator:
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
    costs: Costs = H200Costs(),
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
        PagePool(pages, 16), job.batch, job.budget, decode_width=decode_width, min_width=min_width
    )
    params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True)
    for i in range(job.rows):
        scheduler.add(Request(i, [1] * job.prompt_len, params))
    stopper, draws, result = Stopper(None, set(), 1 << 30), Draws(seed), Replay()
    launched: Launched | None = None
    while scheduler.num_unfinished or launched is not None:
        slots = [req.state.slot for req in scheduler.running]
        scheduled = scheduler.schedule(spec.next_widths(slots, scheduler.prefill_pending))
        new = None
        if scheduled.items:
            if scheduled.admitted:
                admitted = torch.tensor([it.slot for it in scheduled.admitted])
                spec.admit(scheduled.admitted, admitted)
            step = _shape(scheduled, spec.writes_context, job.constrained)
            items = scheduled.items
            new = Launched(
                scheduled,
                step,
                accepted=[_drawn(it.req, it.num_new, accept, draws) for it in items if it.decoding],
                ms=costs.step(step),
            )
            result.seconds += new.ms / 1e3
            if step.num_decoding:
                result.widths[step.max_width] += 1
                result.trace.append(step.max_width)
        if launched is not None:
            _read_back(scheduler, spec, stopper, launched)
        launched = new
    result.tokens = job.rows * job.max_tokens
    return result


def _shape(scheduled: ScheduledStep, writes: bool, constrained: bool) -> ReplayStep:
    items = scheduled.items
    decoding = [it for it in items if it.decoding]
    return ReplayStep(
        widths=tuple(it.num_new for it in decoding),
        decode_slots=tuple(it.slot for it in decoding),
        num_live=len(items),
        prefill_rows=sum(it.num_new for it in items if not it.decoding),
        context=sum(it.req.state.num_cached for it in decoding),
        writes_context=writes or any(not it.decoding for it in items),  # as the runner does
        constrained=constrained,
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
